"""Per-model resources built from util: LoRA buffers, the LoRA manager, tokenizers, samplers.

Components know nothing of sessions or the framework above them.
"""
