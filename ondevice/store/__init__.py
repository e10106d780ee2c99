"""Model acquisition: ``catalog`` (known models, resolution), ``fetch`` (wheels → verified files), ``variants``
(local requantizations), ``sources`` (hf:, ollama:, lmstudio:), ``discovery`` (local models), ``info``."""
