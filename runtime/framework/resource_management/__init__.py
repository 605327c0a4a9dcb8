"""Adapter ids, locks, and each session's context over the one executor."""
