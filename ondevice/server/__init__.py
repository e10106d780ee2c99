"""The local API server: ``app`` (the application), ``routes``, ``driver`` (one request path for every dialect),
the dialects (``chat_completions``, ``completions``, ``responses``: OpenAI, with shared fields in ``openai_api``
and ``structured``; ``messages``: Anthropic), ``embeddings``, ``types`` (what a dialect is), ``errors``,
``models`` (the served models, loaded on demand), ``engine`` (requests → one runtime), ``guard`` (Host/Origin/key
checks) and ``run`` (the process)."""
