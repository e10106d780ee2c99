"""A target sharded over the ranks of an ``mlx.launch`` job: ``world`` (ranks, collectives, heartbeat),
``mlx_backend`` (the sharded MLX target), ``sharded`` (the SPMD runtime), ``tools`` (launch helpers, placement)."""
