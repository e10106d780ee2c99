"""The OpenAI-compatible local server: ``app`` (the application), ``routes``, ``driver`` (one request path for
every dialect), the dialects (``chat_completions``, ``completions``; shared OpenAI fields in ``openai_api`` and
``structured``), ``types`` (what a dialect is), ``errors``, ``engine`` (requests → runtime), ``guard``
(Host/Origin/key checks) and ``run`` (the process)."""
