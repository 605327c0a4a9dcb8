"""Bytes and files: reading adapter tensors, naming conventions, writing LoRA files.

Nothing here knows about models, sessions or the interpreter.
"""
