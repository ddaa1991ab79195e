"""Benchmarks. Each script writes JSON under bench/results/; docs/perf.md and
docs/results.md record the numbers with the command that produced them."""
