"""Engine: one frozen base model, many adapters, many sessions."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from runtime.engine.config import EngineSettings, SessionConfig, check_adapters, check_lora_id
from runtime.components.chat_template import ChatTemplate
from runtime.components.residency import ResidencyPolicy
from runtime.components.tokenizer import HfTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer
from runtime.engine.session import Session, SessionRegistry, check_token_ids
from runtime.engine.speculative import Speculation
from runtime.engine.stats import AdapterStats, EngineStats
from runtime.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError, StatusError
from runtime.executor.litert_executor import KV_LENGTH_HINT, ExecutorSettings, LlmExecutor
from runtime.executor.model_spec import ModelSpec
from runtime.executor.op_profile import OpRecording, summarize
from runtime.executor.weight_cache import IN_MEMORY, weight_cache_file
from runtime.util.model_view import ModelFile
from runtime.framework.lora_source import LoraSource
from runtime.components.lora_manager import normalize_blend
from runtime.framework.resource_management.adapter_registry import AdapterRegistry
from runtime.framework.resource_management.decode_batcher import DecodeBatcher
from runtime.framework.resource_management.executor_pool import ExecutorPool
from runtime.framework.resource_management.resource_manager import ResourceManager
from runtime.util.litertlm_bundle import LitertLmBundle, LlmMetadata, is_litertlm
from runtime.util.model_weights import ModelWeights
from runtime.util.output_projection import read_output_projection
from runtime.util.signature_names import LoraSlot

log = logging.getLogger(__name__)


class Engine:
    """Loads a model once and serves sessions, each with its own adapters.

    Adapters are registered once (by path identity or content digest) and shared by
    every session that asks for them; the base model is never reloaded. Thread-safe.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        settings: EngineSettings | None = None,
        *,
        tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
        chat_template: ChatTemplate | str | None = None,
    ) -> None:
        """``model_path``: a ``.tflite`` LLM export or a ``.litertlm`` bundle (whose
        tokenizer is used unless ``tokenizer`` is given: a Tokenizer, or the path of a
        ``tokenizer.json`` or SentencePiece model). ``chat_template``: how a conversation
        becomes prompt text (a ChatTemplate or its Jinja2 source); ``None`` takes the
        bundle's template (and its bundle's stop tokens go to the bundled tokenizer)."""
        if not isinstance(model_path, str | os.PathLike) or isinstance(os.fspath(model_path), bytes):
            raise InvalidArgumentError(f"model_path={model_path!r:.80}, expected a model file path (a str or "
                                       "os.PathLike)")
        if settings is not None and not isinstance(settings, EngineSettings):
            raise InvalidArgumentError(f"settings={settings!r:.80}, expected an EngineSettings or None")
        if tokenizer is not None and not isinstance(tokenizer, str | os.PathLike) and not all(
                callable(getattr(tokenizer, method, None)) for method in ("encode", "decode")):
            raise InvalidArgumentError(f"tokenizer={tokenizer!r:.80}, expected a Tokenizer (with encode and "
                                       "decode), the path of a tokenizer file, or None")
        if chat_template is not None and not isinstance(chat_template, ChatTemplate | str):
            raise InvalidArgumentError(f"chat_template={chat_template!r:.80}, expected a ChatTemplate, its Jinja2 "
                                       "source, or None")
        self.model_path = Path(model_path)
        self.settings = settings or EngineSettings()
        executor_settings = ExecutorSettings(num_threads=self.settings.num_threads,
                                             profile_ops=self.settings.profile_ops, compile=self.settings.compile)
        bundled_tokenizer = None
        llm_metadata = None
        model: str | os.PathLike[str] | memoryview = self.model_path
        model_part = ""  # which model of the file, for the weight cache's name
        source = None  # where the model lies in the file, for compiling signature groups over views of it
        if is_litertlm(self.model_path):
            with LitertLmBundle(self.model_path) as bundle:
                section = bundle.model_section()
                model = bundle.section_bytes(section)  # the mapping outlives the bundle while the view lives
                model_part = f"litertlm section at {section.begin}"
                source = ModelFile(self.model_path, section.begin, section.end)
                bundled_tokenizer = bundle.tokenizer()
                llm_metadata = bundle.llm_metadata()
        weight_cache = weight_cache_file(self.settings.weight_cache_dir, self.model_path, model_part,
                                         self.settings.weight_cache_max_bytes)
        executors: list[LlmExecutor] = []
        # The chat template and tokenizer are read while the model compiles, which leaves
        # the GIL (a bundle's ~60 + ~100 ms beside a compile of ~90); the template first:
        # reading the tokenizer holds the GIL throughout, so it starts once the compile has.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="runtime-open") as beside:
            text = beside.submit(lambda: (_chat_template(chat_template, llm_metadata),
                                          _tokenizer(tokenizer, bundled_tokenizer, llm_metadata)))
            try:
                for _ in range(self.settings.executors):
                    executors.append(LlmExecutor(model, executor_settings, name=str(self.model_path),
                                                 weight_cache=weight_cache, source=source))
                self.chat_template, self.tokenizer = text.result()
            except BaseException:
                for executor in executors:
                    executor.close()
                raise
        pool = ExecutorPool(executors)
        spec = pool.spec
        self._adapters = AdapterRegistry(
            spec.lora_slots,
            pool.primary.create_lora_buffer,
            head_dim=spec.head_dim,
            base_weights=lambda: ModelWeights.open(model, str(self.model_path)),
            residency=self.settings.lora_residency,
            allow_non_finite=self.settings.allow_non_finite_weights,
            draft_width=spec.hidden_size,
            vocab_size=spec.vocab_size,
        )
        # The weight cache's file, and whether this model's weights were packed in memory instead of there.
        self._weight_cache = weight_cache, executors[0].weight_cache.path == IN_MEMORY
        self._resources = ResourceManager(pool, self._adapters, prefix_cache_bytes=self.settings.prefix_cache_bytes)
        self._batcher = DecodeBatcher(self._resources, self.settings.batch_wait_s)
        self._speculation = Speculation(
            self.settings.speculation,
            self._adapters.draft_heads,
            lambda: read_output_projection(model, self._verify_key(), str(self.model_path)),
        )
        self._sessions = SessionRegistry(self._speculation)
        # Compiles registered adapters' signature groups ahead of their first request, one at a
        # time (its thread starts with the first such compile, and close joins it).
        self._compiles = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runtime-group-compile")
        self._closed = False
        self._lock = threading.Lock()

    def _verify_key(self) -> str:
        """A verify signature's name: its logits come from the lm_head the draft heads share."""
        return next(key for key, signature in self.spec.signatures.items() if signature.kind == "verify")

    @property
    def spec(self) -> ModelSpec:
        """What the model offers: signatures, rank slots, KV length, vocabulary."""
        return self._resources.spec

    def register_adapter(self, source: LoraSource) -> int:
        """Registers an adapter (parse and check only: no buffers until a session runs
        it) and returns its id; the same adapter again returns the same id.

        With ``compile="on-demand"``, the signature group of the LoRA slot the adapter runs
        in (:meth:`slot_for` it alone) starts compiling in the background unless it is
        compiled already, so that the adapter's first request finds it compiled (a request
        arriving meanwhile waits for that compile) and registering does not wait for it."""
        self._check_open()
        if not isinstance(source, LoraSource):
            raise InvalidArgumentError(f"register_adapter takes a LoraSource, got {source!r:.80} "
                                       "(LoraSource(path=...) names a file)")
        lora_id = self._resources.assign_lora_id(source)
        self._prepare_slot(lora_id)
        return lora_id

    def _prepare_slot(self, lora_id: int) -> None:
        """Starts compiling, in the background, the signature groups a session of the LoRA
        slot that adapter ``lora_id`` runs in alone needs (its decode's first, then its
        longer prefills'), on the executors that have not compiled them. Never raises: an
        adapter no slot runs is left to its first session to refuse."""
        try:
            groups = self.spec.session_groups(self.slot_for({lora_id: 1.0}))
        except StatusError as exc:  # no slot runs it, or the engine closed meanwhile
            log.debug("adapter %d: no signature group to compile ahead of its first request: %s", lora_id, exc)
            return
        for group in groups:
            executors = [executor for executor in self._resources.pool.executors
                         if group not in executor.compiled_groups]
            with self._lock:
                if executors and not self._closed:
                    self._compiles.submit(_prepare_group, group, executors)

    def unload_adapter(self, lora_id: int) -> None:
        """Unregisters an adapter no live session uses and frees its buffers."""
        self._check_open()
        check_lora_id(lora_id)
        self._resources.unload_adapter(lora_id)
        self._speculation.forget(lora_id)

    def adapter_ids(self) -> list[int]:
        """The ids of the registered adapters."""
        return self._adapters.ids()

    def adapter(self, lora_id: int) -> AdapterStats:
        """What adapter ``lora_id`` is: its source, format, rank, projections, bytes and
        sessions; ``NotFoundError`` when no adapter has that id."""
        return self._adapters.stats(check_lora_id(lora_id))

    def slot_for(self, adapters: Mapping[int, float], *, names: Mapping[int, str] | None = None) -> LoraSlot | None:
        """The LoRA slot a session with ``adapters`` (id -> scale, a blend when several)
        runs in: the model's cheapest that holds their summed rank and every projection
        they touch; ``None`` for no adapters (the base model). ``InvalidArgumentError``
        naming the adapters and why when no slot of the model can run them (too large a
        summed rank, MLP projections on an attention-only model, a DoRA adapter blended
        with others), each adapter as ``names`` (id -> name) calls it, by default its
        source; ``NotFoundError`` for an unknown id. Sessions, batches and the server
        all ask this one rule."""
        self._check_open()
        return self._resources.slot_for(normalize_blend(check_adapters(adapters).items()), names)

    def create_session(self, config: SessionConfig | None = None) -> Session:
        """A new, empty session running with the adapters ``config`` names."""
        self._check_open()
        config = SessionConfig() if config is None else config
        if not isinstance(config, SessionConfig):
            raise InvalidArgumentError(f"create_session takes a SessionConfig, got {config!r:.80}")
        context = self._resources.create_context_handler(config.sources(), config.adapters.items())
        return Session(self._resources, self._batcher, context, config.sampler, self._sessions, self.tokenizer)

    def decode_together(self, steps: Sequence[tuple[Session, int]]) -> list[np.ndarray]:
        """One decode step for each ``(session, token)`` of this engine, in one pass over
        the weights where the model has batched decode signatures (``export
        --batch-sizes``); each session's logits ``(vocab,)``, in order. Sessions stepping
        from their own threads are batched without this (see ``EngineSettings.batch_wait_s``).

        Sessions must be distinct and idle. Nothing runs unless every session has room
        for its token; if the run fails, no session advances."""
        self._check_open()
        try:
            steps = list(steps)  # a generator is read once
        except TypeError:
            raise InvalidArgumentError(f"decode_together steps (session, token) pairs; got {steps!r:.80}") from None
        odd = [step for step in steps if not isinstance(step, tuple | list) or len(step) != 2]
        if odd:
            raise InvalidArgumentError(f"decode_together steps (session, token) pairs; got {odd[0]!r:.80}")
        sessions = [session for session, _ in steps]
        strangers = [session for session in sessions if not isinstance(session, Session)]
        if strangers:
            raise InvalidArgumentError(f"decode_together steps (session, token) pairs; got {strangers[0]!r:.80} "
                                       "for a session")
        if len({id(s) for s in sessions}) != len(sessions):
            raise InvalidArgumentError("decode_together got one session twice")
        closed = [session.session_id for session in sessions if session.closed]
        if closed:
            raise FailedPreconditionError(f"sessions {closed} are closed")
        foreign = [session.session_id for session in sessions if session not in self._sessions]
        if foreign:
            raise InvalidArgumentError(f"sessions {foreign} belong to another engine")
        tokens = [check_token_ids([token], self.spec.vocab_size)[0] for _, token in steps]
        if not steps:
            return []
        with ExitStack() as held:
            contexts = [held.enter_context(session.reserve()) for session in sessions]
            for session, context in zip(sessions, contexts):
                if context.length + 1 > self.spec.kv_length:
                    raise ResourceExhaustedError(
                        f"session {session.session_id}: 1 token after its {context.length} would exceed "
                        f"the KV cache of {self.spec.kv_length} positions {KV_LENGTH_HINT}")
            for session, context in zip(sessions, contexts):
                session.write_pending(context)  # a generation's last token, alone (rare: after generate)
            start = time.perf_counter()
            logits = self._batcher.decode_together(list(zip(contexts, tokens)))
            seconds = time.perf_counter() - start
            for session, context in zip(sessions, contexts):
                session.record_decode(context, seconds)
        return logits

    @contextmanager
    def profile_ops(self) -> Iterator[OpRecording]:
        """Records where the model's runs inside the ``with`` block spend their time, op by
        op (an engine opened with ``EngineSettings(profile_ops=True)``); the recording's
        ``profile`` is set when the block ends::

            with engine.profile_ops() as recording:
                session.run_decode(token)
            print(recording.profile.table(steps=1))

        Runs are slower while recorded (see :mod:`runtime.executor.op_profile`).
        ``FailedPreconditionError`` when the engine was opened without ``profile_ops`` or
        is recording already."""
        self._check_open()
        executors = self._resources.pool.executors
        recording = OpRecording()
        started = []
        try:
            for executor in executors:
                executor.start_profiling()
                started.append(executor)
            yield recording
        finally:
            events = [event for executor in started for event in executor.stop_profiling()]
        recording.profile = summarize(events)

    def set_residency(self, policy: ResidencyPolicy) -> None:
        """Changes which blends of adapters stay resident; applied at once."""
        self._check_open()
        self._adapters.set_residency(policy)

    def stats(self) -> EngineStats:
        """Registered and resident adapters with their bytes, latencies, residency hits and
        misses, and every live session's counters."""
        report = self._adapters.report()
        invokes, invoke_seconds = self._resources.pool.invoke_totals()
        batch_sizes, queue_wait = self._batcher.report()
        sessions = []
        for session in self._sessions.snapshot():
            try:
                sessions.append(session.stats())
            except FailedPreconditionError:
                continue  # closed meanwhile
        return EngineStats(
            adapters=report.adapters,
            resident=report.resident,
            load=self._adapters.load_latency.summary(),
            materialize=report.residency.materialize,
            switch=self._resources.switch_latency.summary(),
            residency_hits=report.residency.hits,
            residency_misses=report.residency.misses,
            evictions=report.residency.evictions,
            sessions=tuple(sorted(sessions, key=lambda s: s.session_id)),
            invokes=invokes,
            invoke_seconds=invoke_seconds,
            decode_batches=batch_sizes,
            queue_wait=queue_wait,
            speculation=self._speculation.counters.snapshot(),
            prefix_cache=self._resources.prefix_cache_stats(),
            weight_cache=None if self._weight_cache[0] is None else self._weight_cache[0].stats(self._weight_cache[1]),
            compiled_groups=self._resources.pool.primary.compiled_groups,
            group_compile=self._resources.pool.primary.group_compile.summary(),
        )

    def close(self) -> None:
        """Closes every session and releases the model; closing twice is harmless. Waits
        for the sessions' calls other threads are making to end; from inside a session's
        own call (its ``on_token`` callback) ``FailedPreconditionError``, and nothing closes."""
        inside = [session.session_id for session in self._sessions.snapshot() if session.held_by_this_thread]
        if inside:
            raise FailedPreconditionError(f"the engine cannot close inside session {inside[0]}'s call (from its "
                                          "on_token callback?): close it after the call returns")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._compiles.shutdown(wait=False, cancel_futures=True)  # compiles not started yet never start
        for session in self._sessions.close():  # a session being made now is refused and gives its context back
            session.close()
        self._resources.close()
        # A compile under way finds its executor closed and drops its group; no thread outlives the engine.
        self._compiles.shutdown(wait=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPreconditionError(f"{self.model_path}: the engine is closed")


def _prepare_group(group: str, executors: Sequence[LlmExecutor]) -> None:
    """Compiles signature group ``group`` on each of ``executors`` (the engine's background
    step). A failure is logged, not raised: the group's first use compiles it again, and
    raises then as it would have."""
    for executor in executors:
        try:
            executor.prepare(group)
        except FailedPreconditionError as exc:  # the engine closed meanwhile
            log.debug("the signature group %r was not compiled ahead: %s", group, exc)
            return
        except Exception as exc:  # noqa: BLE001 - no caller to raise to; its first use raises it
            log.warning("compiling the signature group %r ahead of its first request failed: %s", group, exc)
            return


def _tokenizer(
    given: Tokenizer | str | os.PathLike[str] | None, bundled: tuple[str, bytes] | None, llm: LlmMetadata | None
) -> Tokenizer | None:
    if given is None and bundled is not None:
        kind, data = bundled
        stops = llm.stop_token_ids if llm is not None and llm.stop_token_ids else None
        return HfTokenizer(data, stops) if kind == "hf" else SentencePieceTokenizer(data, stops)
    if isinstance(given, str | os.PathLike):
        return load_tokenizer(given)
    return given


def _chat_template(given: ChatTemplate | str | None, llm: LlmMetadata | None) -> ChatTemplate | None:
    if isinstance(given, str):
        return ChatTemplate(given)
    if given is None and llm is not None and llm.chat_template:
        return ChatTemplate(llm.chat_template, bos_token=llm.bos_token, eos_token=llm.eos_token)
    return given
