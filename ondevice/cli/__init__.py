"""The ``ondevice`` command: a thin typer layer over the API (``main``), the chat REPL (``repl``) and the
local-model commands (``local``)."""
