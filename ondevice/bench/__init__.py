"""Benchmarks: ``run`` (modes side by side), ``formats`` (the quant advisor), ``oracle`` (best γ in hindsight),
``tools`` (cold start, synthetic models, plots)."""
