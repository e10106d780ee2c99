"""The OpenAI-compatible local server: ``app`` (routes, queue, lifecycle), ``engine`` (requests → runtime),
``openai_api`` (request/response shapes), ``guard`` (Host/Origin/key checks)."""
