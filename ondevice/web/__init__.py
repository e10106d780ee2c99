"""The chat page served at ``/`` by ``ondevice serve`` (index.html, self-contained)."""
