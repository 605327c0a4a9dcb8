"""The command line: ``python -m runtime {inspect, generate}``."""
