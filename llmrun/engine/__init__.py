"""The runner process: llama.cpp behind one adapter (llama.py), continuous batching
(batcher.py), constrained decoding (constraint.py), the sandbox, the runner's start (runner.py,
boot.py) and its side of the channel (host.py, prompt.py, outputs.py).
Only runner processes, the benchmark and the quantizer child import this package."""
