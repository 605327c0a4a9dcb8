"""Finished studies: one-off measurements whose conclusions the docs record (``benchmarks/README.md``)."""
