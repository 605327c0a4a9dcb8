"""Checkpoint (Hugging Face directory or GGUF file) -> ``.tflite`` with LoRA slots, or a
``.litertlm`` bundle.

The only package of the runtime that imports torch, litert-torch and transformers (the
optional ``export`` extra). :mod:`~runtime.export.settings` and
:mod:`~runtime.export.source` need none of them, so bad input is refused before they are
imported; :mod:`~runtime.export.exporter` runs the export.
"""
