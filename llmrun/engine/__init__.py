"""The runner process: llama.cpp behind one adapter (llama/), continuous batching
(batcher.py, over slots.py, encoder.py, sampling.py and speculation.py; what it needs of
the model in backend.py), constrained decoding (constraint.py), the sandbox, the runner's
start (runner.py, boot.py) and its side of the channel (host.py, prompt.py, outputs.py).
Only runner processes, the benchmark and the quantizer child import this package."""
