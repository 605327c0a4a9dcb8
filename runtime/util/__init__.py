"""Bytes and files: scoped files, caches, flatbuffer tables, names, latency counters.

Nothing here knows about adapters, models' sessions or the interpreter.
"""
