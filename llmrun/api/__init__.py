"""HTTP dialects. Each module owns its wire models, stream framing and error shape, and
translates to and from the internal types in `llmrun.request`."""
