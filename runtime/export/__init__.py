"""Checkpoint (Hugging Face directory or GGUF file) -> ``.tflite`` with LoRA slots, or a
``.litertlm`` bundle.

The only package of the runtime that imports torch, litert-torch and transformers (the
optional ``export`` extra). :mod:`~runtime.export.settings` and
:mod:`~runtime.export.source` (and :mod:`~runtime.export.budget`, the memory plan) need none
of them, so bad input is refused before they are imported; :mod:`~runtime.export.exporter`
runs the export: :mod:`~runtime.export.checkpoint` loads it, :mod:`~runtime.export.families`
builds the litert-torch decoder, :mod:`~runtime.export.lowering` traces and lowers its
signatures (in worker processes), :mod:`~runtime.export.convert` makes the flatbuffer, and
:mod:`~runtime.export.measure` records where the time and memory went.
"""
