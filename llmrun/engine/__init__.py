"""The runner process: llama.cpp behind one adapter (llama.py), continuous batching
(batcher.py), constrained decoding (constraint.py), the sandbox, and the IPC loop (runner.py).
Only runner processes, the benchmark and the quantizer child import this package."""
