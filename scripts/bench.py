"""The benchmark, as a script: see llmrun/bench.py (also `llmrun bench MODEL`)."""

from llmrun.bench import main

if __name__ == "__main__":
    main()
