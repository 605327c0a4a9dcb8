"""GGUF files (llama.cpp's format, for base models and LoRA adapters alike): what marks one.
The adapter reader (:mod:`runtime.adapters.gguf_data`), the exporter's source check, and the
refusals of a GGUF file given as a model or a tokenizer all go by it."""

GGUF_MAGIC = b"GGUF"  # a GGUF file's first four bytes
