"""Adapters: what an adapter is on disk and in kind.

One interface (:class:`~runtime.adapters.adapter_data.AdapterData`) over every format: the
``.tflite`` LoRA file (:class:`~runtime.adapters.lora_data.LoraData`, LiteRT-LM's), PEFT
directories and state dicts, llama.cpp GGUF LoRA; the kinds that are rebuilt from the base
model's weights (LoRA-XS, DoRA); draft heads (Turbo LoRA); the LoRA input-name rules and the
``.tflite`` writer. Reads ``runtime.util`` and ``runtime.errors`` only.
"""
