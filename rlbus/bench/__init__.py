"""Benchmarks behind ``rlbus bench <name>``; each measures its own baseline in the same run."""
