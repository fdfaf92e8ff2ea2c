"""The benchmark, as a script: see llmrun/bench/ (also `llmrun bench MODEL`)."""

from llmrun.bench import main

if __name__ == "__main__":
    main()
