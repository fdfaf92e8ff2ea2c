"""`python -m llmrun.bench`: the benchmark's command line (measure.main)."""

from llmrun.bench.measure import main

main()
