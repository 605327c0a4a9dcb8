"""The only place that runs the model: opening it, buffers, running signatures (through
LiteRT's C API, :mod:`runtime.executor.native`).

State that belongs to a session (its KV cache) or to an adapter (its LoRA input buffers)
lives in host buffers (:class:`~runtime.executor.native.HostBuffer`) created here.
Running a step binds the session's buffers to the signature: the KV buffers are bound as
both input and output, so the cache is updated in place (a session's context is copied
only when its steps change attention window, :class:`KvCache`); LoRA buffers are
written once when an adapter is materialized and only bound afterwards. Switching a session or an adapter is
therefore choosing another prebuilt :class:`Binding`, not copying memory. A batched run
takes its rows' adapters stacked in one buffer per LoRA input: a row's adapter is copied
in when another adapter takes that row, and batches of the same sessions copy nothing.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from runtime.executor.batch_plan import DecodePlan
from runtime.executor.native import (
    HostBuffer, NativeModel, PageBlock, PreparedRun, ProfiledEvent, TensorInfo, tensor_info,
)
from runtime.executor.weight_cache import IN_MEMORY, WeightCacheFile, WeightCacheUse
from runtime.util.latency import LatencyRecorder
from runtime.executor import kernels
from runtime.util.attention_rewrite import attention_forms
from runtime.util.kv_layout import named_kv_layout
from runtime.util.model_view import ModelFile, signature_details, view_refusal, weights_read_in_place
from runtime.util.page_advice import read_again_in_huge_pages
from runtime.util.native_logs import mute_native_logs_at_exit, muted_native_logs
from runtime.util.signature_names import VERIFY, LoraSlot
from runtime.executor.model_spec import HIDDEN, INPUT_POS, LOGITS, PLAIN_GROUP, TOKENS, ModelSpec, SignatureSpec

log = logging.getLogger(__name__)

COMPILE_ON_DEMAND = "on-demand"  # the plain group at open, every other group when first needed
COMPILE_ALL = "all"  # every signature at open (a model that cannot be viewed always opens so)
COMPILE_MODES = (COMPILE_ON_DEMAND, COMPILE_ALL)
# What every "exceeds the KV cache of N positions" refusal adds: the export flag that gives more.
KV_LENGTH_HINT = "(a model exported with a larger --kv-length holds more)"

_noticed: set[str] = set()  # the notices given in this process: each once, however many opens
_noticed_lock = threading.Lock()


def _notice(message: str) -> None:
    """Logs ``message`` as a warning (one line on stderr where logging is not configured),
    once per process."""
    with _noticed_lock:
        if message in _noticed:
            return
        _noticed.add(message)
    log.warning(message)


@dataclass(frozen=True)
class ExecutorSettings:
    """How to run the model.

    ``num_threads``: CPU threads for XNNPACK (0 lets the library choose).
    ``native_logs``: let the library print its INFO lines (it offers no switch for them,
    so by default file descriptor 2 is muted while a model loads or closes, and at exit).
    ``profile_ops``: attach LiteRT's op profiler (:meth:`LlmExecutor.start_profiling`);
    such a model is compiled whole, so that every signature's ops are recorded.
    ``compile``: ``"on-demand"`` compiles the plain signatures at open and each other group
    of signatures (:attr:`ModelSpec.groups`: a LoRA slot's, verify, score, a batch size) when a
    session first needs it; ``"all"`` compiles every signature at open. See :class:`LlmExecutor`.
    """

    num_threads: int = 1
    native_logs: bool = False
    profile_ops: bool = False
    compile: str = COMPILE_ON_DEMAND

    def __post_init__(self) -> None:
        if self.num_threads < 0:
            raise InvalidArgumentError(f"num_threads={self.num_threads}, expected >= 0")
        if self.compile not in COMPILE_MODES:
            raise InvalidArgumentError(f"compile={self.compile!r}, expected one of {list(COMPILE_MODES)}")


# What a run costs beside the positions it computes, counted in positions: at least one pass
# over the weights. Low on purpose: a plan pads a position or two more only to save a run.
# (2026-12-04, SmolLM2-135M, 1 thread, same prompts alternating: a 127-token prompt as one
# padded prefill_128 took 0.85x the time of four prefill_32 runs in f32 and 0.96x in int8, 511
# tokens as one padded prefill_512 0.95x / 1.01x of seven runs; 59 tokens as one padded
# prefill_128 took 1.8x two prefill_32 runs.)
RUN_COST_POSITIONS = 2


def prefill_chunks(count: int, lengths: Sequence[int], room: int) -> list[int]:
    """How to prefill ``count`` tokens with the prefill ``lengths`` a model has, when the
    cache has ``room`` positions from the first token on: chunk lengths in order, each a
    prefill length run exactly, the last one possibly padded (a prefill of more positions
    than tokens left, when the cache has room for it), and 1 for a decode step (a
    remainder no padded prefill has room for). Of all such plans the one computing the
    fewest positions, each run counted as :data:`RUN_COST_POSITIONS` more: a 127-token
    prompt is one padded prefill_128, not four prefill_32 runs."""
    # best[r]: the cost of the last r tokens (the first count - r already run) and its first chunk.
    best: list[tuple[int, int]] = [(0, 0)]
    for remaining in range(1, count + 1):
        used = count - remaining  # positions before this chunk
        options = [(RUN_COST_POSITIONS + length + best[remaining - length][0], length)
                   for length in lengths if length <= remaining]
        options += [(RUN_COST_POSITIONS + length, length) for length in lengths
                    if remaining < length <= room - used]  # the last chunk, padded
        if not options:  # no prefill fits: one decode step
            options = [(RUN_COST_POSITIONS + 1 + best[remaining - 1][0], 1)]
        best.append(min(options))
    chunks, remaining = [], count
    while remaining > 0:
        chunks.append(best[remaining][1])
        remaining -= chunks[-1]
    return chunks


class KvCache:
    """One session's KV cache: for each cache length the model's signatures take (every
    attention window's W positions, and the whole cache) a zero-initialized buffer per
    ``kv_cache_*`` input.

    The context lies in the buffers of one length at a time (:attr:`length`); a run of
    another length moves it there first (:meth:`move`): a copy of the filled positions
    only, when a session's steps change window, and the buffers left give their pages
    back. So a signature attending over W positions binds a cache of W positions as it
    lies, and no step copies a window out of a larger cache.

    Buffers lie in small pages until the context fills half their positions, then in
    huge pages (:meth:`reach`; :class:`~runtime.executor.native.PageBlock` says what
    each costs): a short session in a long cache takes memory for what it wrote, a long
    one reads its cache in 2 MB pages.
    """

    def __init__(self, blocks: dict[int, PageBlock], position_axes: Mapping[str, int], nbytes: int) -> None:
        self._blocks = blocks  # by cache length
        self.by_length = {length: block.buffers for length, block in blocks.items()}
        self.length = max(blocks)  # the buffers that hold the context
        self.nbytes = nbytes  # the whole cache's bytes (the buffers of other lengths give their pages back)
        self._axes = position_axes  # by input name

    def at(self, length: int) -> dict[str, HostBuffer]:
        """The buffers of ``length`` positions (bound by the runs of that cache length)."""
        return self.by_length[length]

    def move(self, length: int, filled: int) -> None:
        """Makes the buffers of ``length`` hold the context's first ``filled`` positions,
        copied from the buffers holding them now, whose pages are then released. Only the
        executor's runs call it, under its lock."""
        if length == self.length:
            return
        if filled > min(self.length, length):
            raise InternalError(f"moving {filled} positions of a KV cache from {self.length} to {length} positions")
        held = self.length
        self.length = length
        self.write_positions({name: buffer.array for name, buffer in self.by_length[held].items()}, filled)
        self.release(held)

    def write_positions(self, source: Mapping[str, np.ndarray], length: int) -> None:
        """Writes the first ``length`` positions of each array of ``source`` (by input
        name, laid out as the cache's inputs are, at least ``length`` positions long) into
        the buffers holding the context."""
        self.reach(length)
        for name, buffer in self.by_length[self.length].items():
            axis = self._axes[name]
            _positions(buffer.array, axis, length)[...] = _positions(source[name], axis, length)

    def reach(self, end: int) -> None:
        """Notes that the context's positions up to ``end`` (exclusive) are about to be
        written in the buffers holding it: once that is half of them, they go to huge pages."""
        block = self._blocks[self.length]
        if not block.huge_pages and 2 * end >= self.length:
            block.use_huge_pages()

    def release(self, length: int) -> None:
        """Gives the pages of the buffers of ``length`` back (they read as zeros after)."""
        self._blocks[length].release()

    def clear(self, length: int) -> None:
        """Zeros the buffers of ``length``."""
        self._blocks[length].clear()

    def close(self) -> None:
        """Drops this cache's buffers; they are freed once no binding refers to them.

        Buffers are never destroyed explicitly: a binding still in use would then hand
        freed memory to the interpreter. Their pages go back to the system at once
        (:meth:`PageBlock.release`): the executor keeps its last batch's run, and with it
        the caches of sessions closed since, until a batch of other sessions runs.
        """
        for block in self._blocks.values():
            block.release()
        self.by_length = {}
        self._blocks = {}


@dataclass(frozen=True)
class KvPrefix:
    """A copy of a KV cache's first ``length`` positions: per ``kv_cache_*`` input, its
    slice along the position axis. Caches started from it hold what a prefill of the same
    ``length`` tokens with the same adapters would have written."""

    length: int
    rows: Mapping[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        """Bytes the copy holds."""
        return sum(array.nbytes for array in self.rows.values())


@dataclass
class _SignatureIO:
    """A signature's token, position and logits buffers, and views of their memory:
    ``token_array`` ``[rows, seq]`` and ``position_array`` (flat) are filled in place,
    ``logits_array`` ``[rows * seq, vocab]`` read after a run."""

    index: int
    input_order: list[str]
    output_order: list[str]
    tokens: HostBuffer
    positions: HostBuffer
    logits: HostBuffer | None
    token_array: np.ndarray
    position_array: np.ndarray
    logits_array: np.ndarray | None
    # A verify signature's final hidden states, and their view [L, width].
    hidden: HostBuffer | None = None
    hidden_array: np.ndarray | None = None


@dataclass
class _Run:
    """Prebuilt arguments for one signature, in the signature's order, ready to run."""

    signature: SignatureSpec
    io: _SignatureIO
    prepared: PreparedRun  # which also keeps every bound buffer alive
    caches: tuple[KvCache, ...]  # each row's KV cache, whose buffers of `cache_length` it binds
    cache_length: int
    model: NativeModel  # the compiled model (the signature's group) it runs in


class _LazyRuns(Mapping[Hashable, _Run]):
    """Run arguments made when a step first needs them (which may compile the signature's
    group): the keys are known when a binding is made. Thread-safe."""

    def __init__(self, make: Callable[[Hashable], _Run], keys: Iterable[Hashable]) -> None:
        self._make = make
        self._keys = tuple(dict.fromkeys(keys))
        self._runs: dict[Hashable, _Run] = {}
        self._lock = threading.Lock()

    def __getitem__(self, key: Hashable) -> _Run:
        run = self._runs.get(key)
        if run is None:
            if key not in self._keys:
                raise KeyError(key)
            with self._lock:
                run = self._runs.get(key)
                if run is None:
                    run = self._runs[key] = self._make(key)
        return run

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@dataclass
class _StackedLora:
    """The LoRA inputs of a slot's batched signatures of one row count: every row's adapter
    stacked into one buffer per input, and the adapter buffers each row was filled from
    (``None``: zeros), so a row is copied again only when another adapter takes it. Holding
    them keeps a row's adapter buffers alive until another adapter takes the row (the
    stacked copy is what runs, so buffers of another adapter cannot take their place)."""

    buffers: dict[str, HostBuffer]
    rows: list[Mapping[str, HostBuffer] | None] | None = None  # None: not filled yet


@dataclass
class Binding:
    """A KV cache bound to one LoRA slot's buffers (or none), for every signature of
    one executor."""

    executor: LlmExecutor
    kv: KvCache
    lora_slot: LoraSlot | None
    lora_buffers: Mapping[str, HostBuffer] | None
    decode: _Run  # attending over the whole cache
    prefill: Mapping[int, _Run] = field(default_factory=dict)
    decode_windows: dict[int, _Run] = field(default_factory=dict)  # by attention window
    # These three are made on first use (their signatures' groups compile then).
    verify: Mapping[int, _Run] = field(default_factory=dict)  # by verify length
    score: Mapping[int, _Run] = field(default_factory=dict)  # by score length
    # Prefill and verify steps attending over a window of the cache, by (kind, length, window).
    step_windows: Mapping[tuple[str, int, int], _Run] = field(default_factory=dict)


@dataclass(frozen=True)
class DecodeStep:
    """One session's decode step in a batch: its binding, its token and the position."""

    binding: Binding
    token: int
    position: int


def _one_position_touches_every_page(info: TensorInfo, position_axis: int) -> bool:
    """Whether writing one position of a cache buffer writes into every small page of it:
    positions innermost (a transposed layout's V) in rows no longer than a page."""
    return position_axis == len(info.shape) - 1 and info.shape[-1] * info.dtype.itemsize <= mmap.PAGESIZE


def _positions(array: np.ndarray, axis: int, length: int) -> np.ndarray:
    """The view of ``array``'s first ``length`` positions along ``axis``."""
    return array[(slice(None),) * axis + (slice(0, length),)]


def _row_buffer(signature: SignatureSpec, rows: Sequence[Mapping[str, HostBuffer]], name: str) -> HostBuffer:
    row, single_name = signature.row_input(name)
    return rows[row][single_name]


class LlmExecutor:
    """Runs a litert-torch LLM export on the CPU with per-session KV caches.

    All runs are serialized by an internal lock; buffers and bindings may be created
    from any thread. A run releases the GIL: executors run in parallel.

    Compiling on demand (``ExecutorSettings.compile``, the default): LiteRT's open costs
    about 30-43 ms of CPU per signature it is given (SmolLM2-135M), so the open compiles the
    plain group only (:attr:`ModelSpec.groups`), as its own compiled model over a
    copy-on-write view of the model file (:mod:`runtime.util.model_view`); every other
    group compiles the same way when a step first needs one of its signatures (a session
    bound to a LoRA slot, a verify or score step, a batch of B rows), or earlier when
    :meth:`prepare` asks, under that group's lock, while other sessions' runs go on. The
    views share the file's pages, the groups share the weight cache file the first one
    published (packed weights mapped, not packed again), and a session's buffers bind to
    whichever group runs (no copies). The spec is read from the file's header, not from
    compiled models. A model given as bytes, one that cannot be viewed (control-flow ops
    naming other subgraphs), one whose weights are packed in memory (each group would pack
    its own copy) and one opened for op profiling are compiled whole, as with
    ``compile="all"``.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | bytes | memoryview,
        settings: ExecutorSettings | None = None,
        *,
        name: str | None = None,
        weight_cache: WeightCacheFile | None = None,
        source: ModelFile | None = None,
    ) -> None:
        """``model``: a ``.tflite`` path, or the model's bytes or a view of them, e.g. a
        section of a mapped bundle (then ``name`` labels it).
        ``weight_cache``: the file that keeps XNNPACK's packed weights of this model
        between runs (``None``: they are packed in memory at every open).
        ``source``: where in a file ``model``'s bytes lie (a bundle's model section), so
        that signature groups can compile over views of it; a path is its own source."""
        in_memory = isinstance(model, (bytes, memoryview))
        self.model_path = Path(name or "<in-memory model>") if in_memory else Path(model)
        self.settings = settings or ExecutorSettings()
        if not in_memory and not self.model_path.is_file():
            if self.model_path.exists():  # a directory, a FIFO, a device: as ScopedFile refuses them
                kind = "is a directory" if self.model_path.is_dir() else "is not a regular file"
                raise InvalidArgumentError(f"{self.model_path}: {kind}, expected a model file")
            raise NotFoundError(f"{self.model_path}: no such model file")
        if not self.settings.native_logs:
            mute_native_logs_at_exit()
        if source is None and not in_memory:
            source = ModelFile(self.model_path)
        # XNNPACK packs each signature's weights for its kernels when the model loads; with a
        # weight cache it packs each weight once for all signatures (SmolLM2-135M f32 with 16
        # signatures: 0.4 GiB instead of 7.5 GiB). ":memory:" keeps that cache in memory.
        model_bytes = len(model) if in_memory else self.model_path.stat().st_size
        self._model_bytes = model_bytes
        self._weight_cache_file = weight_cache
        self._models: dict[str, NativeModel] = {}  # by group; compiled whole: every group's is the one model
        self._uses: list[WeightCacheUse] = []  # the weight cache files later groups opened from
        self._io: dict[str, _SignatureIO] = {}  # by signature key, made when its group compiles
        self._lock = threading.Lock()
        self._closed = False
        with (weight_cache.open_for(model_bytes) if weight_cache else nullcontext(WeightCacheUse(IN_MEMORY))) as cache:
            self._source = self._viewable(source, cache)
            # A viewed model carrying both forms of decode attention: the form this machine runs,
            # chosen once for every group (a model opened whole chooses inside NativeModel).
            self._op_form: bool | None = None
            notice = None
            try:
                if self._source is not None:
                    kernels.refuse_unknown_ops(self._source.header(), str(self.model_path))  # groups compile later
                    if attention_forms(self._source.header()):
                        self._op_form, notice = kernels.attention_form_here(str(self.model_path))
                    if self._op_form is not False and weights_read_in_place(self._source.header()):
                        read_again_in_huge_pages(self.model_path)  # before any view maps it
                    details = signature_details(self._source.header(), source=str(self.model_path))
                    self.spec = ModelSpec.from_details(details, str(self.model_path),
                                                       named_kv_layout(self._source.header(), str(self.model_path)))
                    self._models[PLAIN_GROUP], io = self._compile_group(PLAIN_GROUP, cache.path)
                    self._io.update(io)
                else:
                    with self._native_logs():
                        whole = NativeModel(model, num_threads=self.settings.num_threads, weight_cache=cache.path,
                                            name=str(self.model_path), profiling=self.settings.profile_ops)
                    self._models[PLAIN_GROUP] = whole
                    notice = whole.notice
                    named = named_kv_layout(source.header() if source is not None else model, str(self.model_path))
                    self.spec = ModelSpec.from_details(whole.signature_details(), str(self.model_path), named)
                    for group in self.spec.groups:
                        self._models[group] = whole
                        self._io.update(self._group_io(group, whole))
                # A KV cache's inputs per cache length (each window's and the whole cache's).
                self._kv_infos = {self.spec.cache_length(signature): {
                    spec.name: self._tensor_info(signature, spec.name) for spec in self.spec.kv_inputs}
                    for signature in self.spec.signatures.values() if signature.rows == 1}
            except BaseException:
                for compiled in set(self._models.values()):
                    compiled.close()
                raise
        if notice:  # after the native logs are let through again
            _notice(notice)
        self.weight_cache = cache  # the file the packed weights are mapped from, in use until close
        # One lock per group not compiled yet: its first need compiles it once.
        self._group_locks = {group: threading.Lock() for group in self.spec.groups if group not in self._models}
        self._scratch_kv: KvCache | None = None  # the KV cache of padding rows (their results are dropped)
        self._stacked_lora: dict[tuple[int, LoraSlot], _StackedLora] = {}  # by (rows, slot), made when first run
        # The last batched run's key, bindings and arguments: consecutive steps of the same rows.
        self._last_batch: tuple[tuple[int, ...], tuple[Binding, ...], _Run] | None = None
        self.invokes = 0  # signature runs so far, and the seconds spent inside them
        self.invoke_seconds = 0.0
        self._profiling = False  # whether the profiler records
        self.group_compile = LatencyRecorder(window=64)  # compiling a signature group on its first need

    def _viewable(self, source: ModelFile | None, cache: WeightCacheUse) -> ModelFile | None:
        """``source`` when its signature groups are to compile apart, else ``None`` (the
        model compiles whole: see the class)."""
        if (source is None or self.settings.compile != COMPILE_ON_DEMAND or self.settings.profile_ops
                or cache.path == IN_MEMORY):
            return None
        reason = view_refusal(source.header(), str(self.model_path))
        if reason:
            log.debug("compiling every signature at open: %s", reason)
            return None
        return source

    @property
    def attention_kernel(self) -> bool:
        """Whether the decode signatures run their attention in the runtime's custom op
        (docs/kernels.md): a model exported with it, on a machine where it builds."""
        return self._models[PLAIN_GROUP].attention_kernel

    @property
    def compiled_groups(self) -> tuple[str, ...]:
        """The signature groups compiled so far (:attr:`ModelSpec.groups`' names)."""
        return tuple(group for group in self.spec.groups if group in self._models)

    def _compile_group(self, group: str, weight_cache: str) -> tuple[NativeModel, dict[str, _SignatureIO]]:
        """Compiles ``group`` over a view of the model file naming XNNPACK's ``weight_cache``;
        the compiled model and its signatures' token, position and logits buffers, which
        the caller adds to the executor's."""
        keys = self.spec.groups[group]
        view = self._source.view(keys, attention_op_form=self._op_form)  # type: ignore[union-attr]
        with self._native_logs():
            compiled = NativeModel(view.data, num_threads=self.settings.num_threads, weight_cache=weight_cache,
                                   name=f"{self.model_path} (signatures {', '.join(keys)})",
                                   custom_ops=self._op_form)
        try:
            self._check_details(compiled, keys)
            return compiled, self._group_io(group, compiled)
        except BaseException:
            compiled.close()
            raise

    def prepare(self, group: str) -> None:
        """Compiles the signature group ``group`` (a name of :attr:`ModelSpec.groups`) now,
        unless it is compiled already, so that the first step needing it does not wait for
        it (the engine calls it in the background when an adapter is registered). As with a
        step's first need: once however many threads ask (a step arriving meanwhile waits
        for this compile), and other groups' runs go on. ``NotFoundError`` for a group the
        model does not have; ``FailedPreconditionError`` when the executor is closed, also
        when it was closed while the group compiled (the compiled model is then dropped)."""
        if group not in self.spec.groups:
            raise NotFoundError(f"{self.model_path}: no signature group {group!r} (groups: "
                                f"{', '.join(self.spec.groups)})")
        self._check_open()
        self._group_model(group)

    def _group_model(self, group: str) -> NativeModel:
        """The compiled model of ``group``, compiled now if this is its first need (once,
        however many threads ask at once; other groups' runs go on meanwhile)."""
        compiled = self._models.get(group)
        if compiled is not None:
            return compiled
        with self._group_locks[group]:
            compiled = self._models.get(group)
            if compiled is not None:
                return compiled
            self._check_open()
            started = time.perf_counter()
            # The file the plain group published: mapped, not written (if it went meanwhile, built again).
            with self._weight_cache_file.open_for(self._model_bytes) as cache:  # type: ignore[union-attr]
                compiled, io = self._compile_group(group, cache.path)
                with self._lock:
                    if self._closed:  # closed while this group compiled: raising releases the file's use
                        compiled.close()
                        self._check_open()
                    self._models[group] = compiled
                    self._io.update(io)
                    self._uses.append(cache)
            seconds = time.perf_counter() - started
            self.group_compile.record(seconds)
            log.debug("%s: compiled the signature group %r (%d signatures) in %.0f ms", self.model_path, group,
                      len(self.spec.groups[group]), seconds * 1e3)
            return compiled

    def _check_details(self, compiled: NativeModel, keys: Sequence[str]) -> None:
        """``InternalError`` unless the library describes the view's signatures ``keys`` as
        the header read for the spec did (a view LiteRT misread would run wrong tensors)."""
        if set(compiled.signatures) != set(keys):
            raise InternalError(f"{self.model_path}: a view of signatures {list(keys)} compiled as "
                                f"{sorted(compiled.signatures)}")
        for key in keys:
            signature, described = self.spec.signatures[key], compiled.signatures[key]
            for side, expected, got in (("input", signature.inputs, described.inputs),
                                        ("output", signature.outputs, described.outputs)):
                if list(expected) != list(got):
                    raise InternalError(f"{self.model_path}: signature {key!r} {side}s compiled in the order "
                                        f"{list(got)[:4]}..., its header says {list(expected)[:4]}...")
                for name, spec in expected.items():
                    info = got.get(name)
                    if info is None or info.shape != spec.shape or info.dtype != spec.dtype:
                        found = f"{list(info.shape)} {info.dtype}" if info else "missing"
                        raise InternalError(f"{self.model_path}: signature {key!r} {side} {name!r} compiled as "
                                            f"{found}, its header says {spec.describe()}")

    def _group_io(self, group: str, compiled: NativeModel) -> dict[str, _SignatureIO]:
        """Token, position and logits buffers of ``group``'s signatures by key, shared by
        all sessions (runs are serialized)."""
        return {key: self._signature_io(key, self.spec.signatures[key], compiled) for key in self.spec.groups[group]}

    def _tensor_info(self, signature: SignatureSpec, name: str, output: bool = False) -> TensorInfo:
        """Input (or output) ``name`` of ``signature`` as the library describes it: from its
        group's compiled model, or made from the spec before that group compiles."""
        compiled = self._models.get(self.spec.group_of(signature))
        if compiled is not None:
            described = compiled.signatures[signature.key]
            return (described.outputs if output else described.inputs)[name]
        spec = (signature.outputs if output else signature.inputs)[name]
        return tensor_info(spec.name, spec.shape, spec.dtype)

    def _signature_io(self, key: str, signature: SignatureSpec, compiled: NativeModel) -> _SignatureIO:
        described = compiled.signatures[key]
        tokens = HostBuffer(described.inputs[TOKENS])
        positions = HostBuffer(described.inputs[INPUT_POS])
        logits = HostBuffer(described.outputs[LOGITS]) if signature.has_logits else None
        io = _SignatureIO(
            index=described.index,
            input_order=list(described.inputs),
            output_order=list(described.outputs),
            tokens=tokens,
            positions=positions,
            logits=logits,
            token_array=tokens.array.reshape(signature.rows, signature.seq_len),
            position_array=positions.array.reshape(-1),
            logits_array=None if logits is None else logits.array.reshape(-1, self.spec.vocab_size),
        )
        if HIDDEN in signature.outputs:
            io.hidden = HostBuffer(described.outputs[HIDDEN])
            io.hidden_array = io.hidden.array.reshape(signature.seq_len, signature.outputs[HIDDEN].shape[-1])
        return io

    # -- profiling -----------------------------------------------------------------

    def start_profiling(self) -> None:
        """Records every op of this executor's runs from now on, until :meth:`stop_profiling`.
        ``FailedPreconditionError`` unless the executor was opened with ``profile_ops`` and
        is not recording already."""
        with self._lock:
            self._check_open()
            if not self.settings.profile_ops:
                raise FailedPreconditionError(f"{self.model_path}: opened without profile_ops, so LiteRT's "
                                              "profiler is not attached")
            if self._profiling:
                raise FailedPreconditionError(f"{self.model_path}: its runs are being recorded already")
            self._models[PLAIN_GROUP].start_profiling()  # opened for profiling: compiled whole
            self._profiling = True

    def stop_profiling(self) -> list[ProfiledEvent]:
        """Stops recording; what the runs since :meth:`start_profiling` recorded.
        ``FailedPreconditionError`` when not recording, or when the executor is closed (its
        profiler went with the compiled model)."""
        with self._lock:
            self._check_open()
            if not self._profiling:
                raise FailedPreconditionError(f"{self.model_path}: its runs are not being recorded")
            self._profiling = False
            return self._models[PLAIN_GROUP].stop_profiling()

    # -- buffers -------------------------------------------------------------------

    def create_kv_cache(self) -> KvCache:
        """A fresh, zeroed KV cache (zeroed: NaN bits in masked slots would poison logits),
        with buffers of every cache length the model's signatures take; pages not yet
        written take no memory."""
        self._check_open()
        axes = {spec.name: self.spec.kv_position_axis(spec.name) for spec in self.spec.kv_inputs}
        blocks = {length: PageBlock(list(infos.values()), [info.name for info in infos.values()
                                                           if _one_position_touches_every_page(info, axes[info.name])])
                  for length, infos in self._kv_infos.items()}
        return KvCache(blocks, axes, self.spec.kv_cache_bytes)

    def copy_kv_cache(self, source: KvCache, length: int) -> KvCache:
        """A new KV cache holding ``source``'s first ``length`` positions (a context's
        position: what its next steps read), zeros after them."""
        if not 0 <= length <= self.spec.kv_length:
            raise InvalidArgumentError(f"copying {length} positions of a KV cache, expected 0 ... {self.spec.kv_length}")
        copy = self.create_kv_cache()
        with self._lock:
            if length > source.length:
                raise InternalError(f"copying {length} positions of a context in {source.length}")
            copy.length = source.length
            copy.write_positions({name: buffer.array for name, buffer in source.at(source.length).items()}, length)
        return copy

    def read_kv_prefix(self, kv: KvCache, length: int) -> KvPrefix:
        """A copy of ``kv``'s first ``length`` positions."""
        if not 0 < length <= self.spec.kv_length:
            raise InvalidArgumentError(f"a KV prefix of {length} positions, expected 1 ... {self.spec.kv_length}")
        rows = {}
        with self._lock:
            if length > kv.length:
                raise InternalError(f"a KV prefix of {length} positions from a context in {kv.length}")
            for spec in self.spec.kv_inputs:
                data = kv.at(kv.length)[spec.name].array
                rows[spec.name] = _positions(data, self.spec.kv_position_axis(spec.name), length).copy()
        return KvPrefix(length, rows)

    def write_kv_prefix(self, kv: KvCache, prefix: KvPrefix, length: int) -> None:
        """Makes ``kv`` hold ``prefix``'s first ``length`` positions, zeros after them (the
        cache of a context that no run is using), in the shortest buffers with room for
        the next position too."""
        if not 0 < length <= prefix.length:
            raise InvalidArgumentError(f"{length} positions of a KV prefix of {prefix.length}")
        kv.length = next((n for n in sorted(kv.by_length) if n > length), self.spec.kv_length)
        for held in kv.by_length:
            if held == kv.length:
                kv.clear(held)
            else:
                kv.release(held)
        kv.write_positions(prefix.rows, length)

    def create_lora_buffer(self, slot: LoraSlot, name: str) -> HostBuffer:
        """An empty buffer for LoRA input ``name`` of ``slot``."""
        self._check_open()
        signature = self.spec.decode(slot)
        if name not in signature.lora_inputs:
            raise NotFoundError(f"LoRA slot {slot} has no LoRA input {name!r}")
        return HostBuffer(self._tensor_info(signature, name))

    def bind(
        self, kv: KvCache, lora_buffers: Mapping[str, HostBuffer] | None = None, lora_slot: LoraSlot | None = None
    ) -> Binding:
        """The run arguments of every signature for ``kv`` and a LoRA slot: the decode
        steps' now, the others' when first run."""
        if (lora_buffers is None) != (lora_slot is None):
            raise InvalidArgumentError("lora_buffers and lora_slot go together")
        self._check_open()
        spec = self.spec

        def made(signature: SignatureSpec) -> _Run:
            return self._run_args(signature, kv, lora_buffers)

        # The slot's decode steps now (their group compiles on the slot's first binding); its
        # prefills, verify and score steps, and windowed steps, when first run (a longer
        # prefill's group compiles then).
        binding = Binding(self, kv, lora_slot, lora_buffers, made(spec.decode(lora_slot)))
        binding.prefill = _LazyRuns(lambda length: made(spec.prefill(length, lora_slot)), spec.prefill_lengths)
        binding.decode_windows = {window: made(spec.decode(lora_slot, window)) for window in spec.windows(lora_slot)}
        binding.score = _LazyRuns(lambda length: made(spec.score(length, lora_slot)), spec.score_lengths(lora_slot))
        binding.verify = _LazyRuns(lambda length: made(spec.verify(length, lora_slot)), spec.verify_lengths(lora_slot))
        steps = [("prefill", length, window) for length in spec.prefill_lengths
                 for window in spec.windows(lora_slot, kind="prefill", seq_len=length)]
        steps += [(VERIFY, length, window) for length in spec.verify_lengths(lora_slot)
                  for window in spec.windows(lora_slot, kind=VERIFY, seq_len=length)]
        binding.step_windows = _LazyRuns(
            lambda step: made((spec.prefill if step[0] == "prefill" else spec.verify)(step[1], lora_slot, step[2])),
            steps)
        return binding

    def _run_args(
        self, signature: SignatureSpec, kv: KvCache, lora_buffers: Mapping[str, HostBuffer] | None
    ) -> _Run:
        model = self._group_model(self.spec.group_of(signature))
        with self._lock:  # a close meanwhile drops the signatures' io
            self._check_open()
            io = self._io[signature.key]
        length = self.spec.cache_length(signature)
        inputs = {TOKENS: io.tokens, INPUT_POS: io.positions, **kv.at(length)}
        expected_lora = set(signature.lora_inputs)
        given = set(lora_buffers or {})
        if given != expected_lora:
            raise InvalidArgumentError(
                f"signature {signature.key!r} takes LoRA inputs {sorted(expected_lora)[:4]}..., "
                f"got {sorted(given)[:4]}..."
            )
        inputs.update(lora_buffers or {})
        outputs = dict(kv.at(length))
        if io.logits is not None:
            outputs[LOGITS] = io.logits
        if io.hidden is not None:
            outputs[HIDDEN] = io.hidden
        ordered_inputs = [inputs[name] for name in io.input_order]
        ordered_outputs = [outputs[name] for name in io.output_order]
        return _Run(signature, io, model.prepare(io.index, ordered_inputs, ordered_outputs), (kv,), length, model)

    # -- running -------------------------------------------------------------------

    def decode(self, binding: Binding, token: int, position: int) -> np.ndarray:
        """Runs one token at ``position``; returns the logits for the next, ``(vocab,)`` float32."""
        self._check_position(position, 1)
        run = self._decode_run(binding, position)
        with self._lock:
            self._check_open()
            logits = self._invoke(run, [token], position)
        return logits[0]

    def prefill(self, binding: Binding, tokens: Sequence[int], start: int) -> np.ndarray:
        """Appends ``tokens`` at positions ``start...``; returns the logits after the last.

        Runs the prefill signatures :func:`prefill_chunks` plans, decode steps for a
        remainder no padded prefill has room for. A model whose prefill returns no logits
        gets its last token decoded. Other sessions' runs (decode batches) may go between
        the chunks: a long prompt does not stall them.
        """
        if not tokens:
            raise InvalidArgumentError("prefill needs at least one token")
        self._check_position(start, len(tokens))
        logits: np.ndarray | None = None
        pos, rest = start, list(tokens)
        for length, taken in self._prefill_plan(len(rest), start):
            chunk, rest = rest[:taken], rest[taken:]
            run = self._decode_run(binding, pos) if length == 1 else self._step_run(binding, "prefill", length, pos)
            with self._lock:
                self._check_open()
                out = self._invoke(run, chunk, pos)
            logits = out[len(chunk) - 1] if out is not None else None
            pos += len(chunk)
        if logits is None:
            raise InternalError("prefill produced no logits")
        return logits

    def prefill_decode_steps(self, count: int, start: int) -> int:
        """How many of ``count`` tokens a :meth:`prefill` at ``start`` runs as decode steps
        (its last ones): a remainder no padded prefill has room for, and the last token of
        a model whose prefill returns no logits. The others' positions are what prefill
        signatures compute however a prompt is chunked; a decode step's linear layers may
        sum in another order (the kernels' op form)."""
        return sum(1 for length, _ in self._prefill_plan(count, start) if length == 1)

    def _prefill_plan(self, count: int, start: int) -> list[tuple[int, int]]:
        """The runs of a prefill of ``count`` tokens at ``start``, in order: each one's
        length (a prefill length, or 1 for a decode step) and the tokens it takes (fewer
        in a padded prefill)."""
        bulk = count if self.spec.prefill_has_logits else count - 1  # else the last token is decoded
        runs = []
        for length in prefill_chunks(bulk, self.spec.prefill_lengths, self.spec.kv_length - start):
            runs.append((length, min(length, bulk)))
            bulk -= runs[-1][1]
        return runs if self.spec.prefill_has_logits else [*runs, (1, 1)]

    def score(self, binding: Binding, tokens: Sequence[int], start: int, *, decode_steps: bool = False
              ) -> np.ndarray:
        """Appends ``tokens`` at positions ``start...`` like :meth:`prefill`, keeping the
        logits at every position: ``(len(tokens), vocab)`` float32, row i the logits after
        ``tokens[i]`` (what scoring a prompt reads). Runs, in order of preference, the
        ``score_{L}`` signatures (``runtime export --score-lengths``: prefills that return
        logits, beside plain prefills that do not), the prefill signatures where they
        return logits (``--prefill-logits``), or with ``decode_steps`` one decode step per
        token (the decode signature's own logits); else ``FailedPreconditionError`` naming
        the export flags. Each plan chunks the tokens as a prefill does."""
        if not tokens:
            raise InvalidArgumentError("scoring needs at least one token")
        if binding.score:
            kind, lengths = "score", tuple(sorted(binding.score))
        elif self.spec.prefill_has_logits:
            kind, lengths = "prefill", self.spec.prefill_lengths
        elif decode_steps:
            kind, lengths = "decode", ()
        else:
            raise FailedPreconditionError(
                f"{self.model_path.name}: it has no score signatures and its prefill signatures return no logits, so "
                "a prompt's logprobs need one decode step per token; export the model again with `runtime export "
                "--score-lengths 128,512` (or --prefill-logits), or allow decode steps")
        self._check_position(start, len(tokens))
        scored = np.empty((len(tokens), self.spec.vocab_size), np.float32)
        pos, done = start, 0
        for length in prefill_chunks(len(tokens), lengths, self.spec.kv_length - start):
            chunk = list(tokens[done:done + length])
            if length == 1:
                run = self._decode_run(binding, pos)
            else:
                run = binding.score[length] if kind == "score" else self._step_run(binding, "prefill", length, pos)
            with self._lock:
                self._check_open()
                out = self._invoke(run, chunk, pos)
            scored[done:done + len(chunk)] = out[: len(chunk)]  # type: ignore[index]
            done += len(chunk)
            pos += len(chunk)
        return scored

    def verify(self, binding: Binding, tokens: Sequence[int], start: int) -> tuple[np.ndarray, np.ndarray]:
        """Runs ``tokens`` (the trunk's token and the drafts after it) at positions
        ``start...`` in one ``verify{L}`` run, L the shortest verify length that holds them;
        padding fills the rest (its KV rows lie past what the caller keeps and are
        overwritten before anything attends to them, so all L positions must fit the
        cache). Returns the logits ``(n, vocab)`` and final hidden states ``(n, width)``
        of the n tokens given."""
        lengths = [length for length in sorted(binding.verify) if length >= len(tokens)]
        if not tokens or not lengths:
            raise InvalidArgumentError(f"verify takes 1 ... {max(binding.verify, default=0)} tokens, got {len(tokens)}"
                                       + ("" if binding.verify else " (the model has no verify signatures)"))
        length = lengths[0]
        self._check_position(start, length)
        run = self._step_run(binding, VERIFY, length, start)
        hidden = np.empty(run.io.hidden_array.shape, np.float32)  # type: ignore[union-attr]
        with self._lock:
            self._check_open()
            logits = self._invoke(run, tokens, start)
            hidden[...] = run.io.hidden_array
        return logits[: len(tokens)], hidden[: len(tokens)]  # type: ignore[index]

    def _step_run(self, binding: Binding, kind: str, length: int, start: int) -> _Run:
        """The ``kind`` (prefill or verify) run of ``length`` tokens from ``start``: the
        shortest attention window that holds all of them (padding too: a window's cache
        has no room past it), else the whole cache."""
        window = self.spec.window_for(start + length - 1, binding.lora_slot, kind=kind, seq_len=length)
        if window is not None:
            return binding.step_windows[kind, length, window]
        return binding.prefill[length] if kind == "prefill" else binding.verify[length]

    def _decode_run(self, binding: Binding, position: int) -> _Run:
        """The decode run for a step at ``position``: the shortest attention window that
        holds it, else the whole cache."""
        window = self.spec.window_for(position, binding.lora_slot)
        return binding.decode if window is None else binding.decode_windows[window]

    def run_decode_plan(self, plan: DecodePlan, steps: Sequence[DecodeStep]) -> list[np.ndarray | BaseException]:
        """Runs the decode steps of a batch as ``plan`` (:func:`plan_decode` over these
        steps) says; returns each step's logits ``(vocab,)``, or the error of that step
        alone (a position past the KV cache). A failing run raises for all.

        Each row of a batched run binds its own KV cache and LoRA buffers (rows without
        an adapter, and padding rows, zero LoRA inputs; padding rows a scratch KV cache).
        """
        results: list[np.ndarray | BaseException | None] = [None] * len(steps)
        for planned in plan.runs:  # a batch size's first run compiles its group, outside the run lock
            self._group_model(self.spec.group_of(planned.signature))
        for index in plan.overflow:
            try:
                self._check_position(steps[index].position, 1)
            except (ResourceExhaustedError, InvalidArgumentError) as exc:
                results[index] = exc
        with self._lock:
            self._check_open()
            for planned in plan.runs:
                signature = planned.signature
                if signature.rows == 1:
                    step = steps[planned.rows[0]]
                    run = step.binding.decode if signature.window is None else step.binding.decode_windows[signature.window]
                    if run.signature is not signature:
                        raise InternalError(f"the plan runs {signature.key!r} for a session bound to {run.signature.key!r}")
                    results[planned.rows[0]] = self._invoke(run, [step.token], step.position)[0]
                    continue
                logits = self._invoke_batch(signature, [steps[i] for i in planned.rows])
                for row, index in enumerate(planned.rows):
                    results[index] = logits[row]
        return results  # type: ignore[return-value]

    def _invoke_batch(self, signature: SignatureSpec, steps: Sequence[DecodeStep]) -> np.ndarray:
        """One run of a batched ``signature`` for ``steps`` (padded to its rows); the
        logits ``(rows, vocab)``."""
        bindings = tuple(step.binding for step in steps)
        key = (id(signature), *map(id, bindings))
        if self._last_batch is not None and self._last_batch[0] == key:
            run = self._last_batch[2]
        else:
            run = self._batch_run(signature, bindings)
            # The bindings are kept with their run: while cached, no other binding can take their ids.
            self._last_batch = (key, bindings, run)
        io = run.io
        io.token_array[:] = 0
        io.position_array[:] = 0
        for row, step in enumerate(steps):
            io.token_array[row, 0] = step.token
            io.position_array[row] = step.position
        return self._run_filled(run)

    def _batch_run(self, signature: SignatureSpec, bindings: Sequence[Binding]) -> _Run:
        """Run arguments binding each row's own KV cache (no copies) and the slot's stacked
        LoRA inputs, filled with the rows' adapters; rows past ``bindings`` get the scratch
        KV cache and zero LoRA weights."""
        caches = [binding.kv for binding in bindings]
        if len(caches) < signature.rows:
            if self._scratch_kv is None:
                self._scratch_kv = self.create_kv_cache()
            caches += [self._scratch_kv] * (signature.rows - len(caches))
        length = self.spec.cache_length(signature)
        kv_rows = [cache.at(length) for cache in caches]
        model = self._models[self.spec.group_of(signature)]  # compiled before the run lock was taken
        io = self._io[signature.key]
        shared_inputs = {TOKENS: io.tokens, INPUT_POS: io.positions}
        if signature.lora_slot is not None:
            slot = signature.lora_slot
            adapters = [binding.lora_buffers if binding.lora_slot == slot else None for binding in bindings]
            shared_inputs.update(self._fill_stacked_lora(signature, adapters))
        inputs = [shared_inputs[name] if name in shared_inputs else _row_buffer(signature, kv_rows, name)
                  for name in io.input_order]
        outputs = [io.logits if name == LOGITS else _row_buffer(signature, kv_rows, name) for name in io.output_order]
        return _Run(signature, io, model.prepare(io.index, inputs, outputs), tuple(caches), length, model)

    def _fill_stacked_lora(self, signature: SignatureSpec,
                           adapters: Sequence[Mapping[str, HostBuffer] | None]) -> dict[str, HostBuffer]:
        """The stacked LoRA inputs of ``signature``'s rows and slot, holding ``adapters``
        row by row (``None`` and rows past them: zeros). Only rows whose adapter changed
        since the last fill are copied; a batch of the same sessions copies nothing."""
        slot, rows = signature.lora_slot, signature.rows
        stacked = self._stacked_lora.get((rows, slot))
        if stacked is None:
            buffers = {name: HostBuffer(self._tensor_info(signature, name)) for name in signature.lora_inputs}
            stacked = self._stacked_lora[rows, slot] = _StackedLora(buffers)
        wanted = [*adapters, *[None] * (rows - len(adapters))]
        changed = range(rows) if stacked.rows is None else [
            row for row in range(rows) if stacked.rows[row] is not wanted[row]]
        if not changed:
            return stacked.buffers
        for name in signature.lora_inputs:
            host = stacked.buffers[name].array
            for row in changed:
                if wanted[row] is None:
                    host[row] = 0.0
                else:
                    host[row] = wanted[row][name].array
        stacked.rows = wanted
        return stacked.buffers

    def _invoke(self, run: _Run, chunk: Sequence[int], start: int) -> np.ndarray | None:
        """Writes tokens and positions (padded to the signature's length) and runs it."""
        length = run.signature.seq_len
        io = run.io
        if length == 1:
            io.token_array[0, 0] = chunk[0]
            io.position_array[0] = start
        else:
            io.token_array[0, : len(chunk)] = chunk
            io.token_array[0, len(chunk) :] = 0
            io.position_array[:] = range(start, start + length)
        return self._run_filled(run)

    def _run_filled(self, run: _Run) -> np.ndarray | None:
        """Runs ``run`` with its token and position arrays as filled: writes them, runs the
        signature (counted and timed) and returns its logits (``None`` when it has none)."""
        io = run.io
        seq_len = run.signature.seq_len
        for row, cache in enumerate(run.caches):
            start = int(io.position_array[row * seq_len])
            if cache.length != run.cache_length:  # the row's context is in buffers of another length
                cache.move(run.cache_length, start)
            cache.reach(start + seq_len)
        # A fresh array each step (callers keep logits while later steps run), allocated
        # before the run: right after an invoke the same allocation took 10 us, not 0.3.
        logits = np.empty(io.logits_array.shape, np.float32) if io.logits_array is not None else None
        started = time.perf_counter()
        try:
            run.model.run(run.prepared)
        except InternalError as exc:
            raise InternalError(f"running {run.signature.key!r} failed: {exc.args[0]}") from None
        self.invoke_seconds += time.perf_counter() - started
        self.invokes += 1
        if logits is not None:
            logits[...] = io.logits_array
        return logits

    def _check_position(self, start: int, count: int) -> None:
        if start < 0:
            raise InvalidArgumentError(f"position {start} is negative")
        if start + count > self.spec.kv_length:
            raise ResourceExhaustedError(
                f"{count} token(s) at position {start} would exceed the KV cache of "
                f"{self.spec.kv_length} positions {KV_LENGTH_HINT}"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPreconditionError(f"{self.model_path}: executor is closed")

    def close(self) -> None:
        """Releases the model; later calls raise ``FailedPreconditionError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with self._native_logs():
                for compiled in set(self._models.values()):
                    compiled.close()
                self.weight_cache.release()
                for use in self._uses:
                    use.release()
                self._last_batch = self._scratch_kv = None
                self._stacked_lora.clear()
                del self._io

    def _native_logs(self) -> AbstractContextManager[None]:
        return nullcontext() if self.settings.native_logs else muted_native_logs()
