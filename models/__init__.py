"""Catalog data (``catalog.toml``), shipped inside the ``ondevice.models`` package."""
