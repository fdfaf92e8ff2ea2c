"""How a model's conversation is written: chat templates (Jinja and Go), tool-call formats,
thinking markers, stop-safe text streaming, JSON schemas for constrained output.

Pure Python, below the store: the daemon (store validation, dialects) and the runner both
use it, so neither needs the other's code, and nothing here loads llama.cpp.
"""
