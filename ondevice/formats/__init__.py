"""Formats shared by the runtime and the converters: GGUF reading, vocab/pair checks, the reference decoder, the MIL interpreter."""
