"""An on-device LLM runtime: one frozen TFLite base model, many LoRA adapters.

Adapters are attached per session, from files or from memory, and swapped at run time
without reloading the base model::

    from runtime import Engine, EngineSettings, SessionConfig, LoraSource

    engine = Engine("model.tflite", settings=EngineSettings(num_threads=1))
    session = engine.create_session(SessionConfig(lora_path="adapter.tflite"))
    logits = session.run_prefill([5, 17, 42])
"""

from runtime.components.residency import KeepAll, Lru, OnlyActive
from runtime.components.sampler import Sampler, SamplerConfig
from runtime.components.tokenizer import ByteTokenizer, HfTokenizer, SentencePieceTokenizer, Tokenizer
from runtime.engine.config import EngineSettings, SessionConfig
from runtime.engine.engine import Engine
from runtime.engine.session import GenerationResult, Session
from runtime.components.chat_template import ChatTemplate
from runtime.engine.stats import AdapterStats, EngineStats, ResidentStats, SessionStats
from runtime.errors import (
    AlreadyExistsError,
    DataLossError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    StatusError,
    UnavailableError,
    UnimplementedError,
)
from runtime.framework.lora_source import LoraSource
from runtime.util.latency import LatencySummary

__all__ = [
    "AdapterStats",
    "AlreadyExistsError",
    "ByteTokenizer",
    "ChatTemplate",
    "DataLossError",
    "Engine",
    "EngineSettings",
    "EngineStats",
    "FailedPreconditionError",
    "GenerationResult",
    "HfTokenizer",
    "InternalError",
    "InvalidArgumentError",
    "KeepAll",
    "LatencySummary",
    "LoraSource",
    "Lru",
    "NotFoundError",
    "OnlyActive",
    "PermissionDeniedError",
    "ResidentStats",
    "ResourceExhaustedError",
    "Sampler",
    "SamplerConfig",
    "SentencePieceTokenizer",
    "Session",
    "SessionConfig",
    "SessionStats",
    "StatusError",
    "Tokenizer",
    "UnavailableError",
    "UnimplementedError",
]
