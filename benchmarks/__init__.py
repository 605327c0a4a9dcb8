"""The benchmark suite and the finished studies; run from the repository root as
``python3 -m benchmarks.run`` (see ``benchmarks/README.md``)."""
