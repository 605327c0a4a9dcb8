"""What an export produces: rank slots, KV length, prefill lengths, precision, KV layout."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import InvalidArgumentError
from runtime.util.kv_layout import KV_LAYOUT_GROUPED, KV_LAYOUT_TRANSPOSED, KV_LAYOUTS

# The KV layouts the runtime's attention kernel reads (litert-torch's default is not one).
KERNEL_KV_LAYOUTS = (KV_LAYOUT_TRANSPOSED, KV_LAYOUT_GROUPED)

# Our names -> litert-torch 0.10.0's quantization recipe names. Only recipes whose
# exports run in this runtime are offered (tests/test_export.py runs each one).
QUANTIZATIONS = {
    "none": "none",
    "int8": "dynamic_int8",
    "int8-weights": "weight_only_int8",
    "fp16": "fp16",
    "int4-block32": "dynamic_int4_block32",
    "int4-block128": "dynamic_int4_block128",
}
# How decode signatures compute attention (docs/kernels.md): "auto" (the default) writes both
# forms, the standard ops and one custom op per layer (odml_runtime.decode_attention, whose
# kernel this runtime compiles on the user's machine) sharing every weight, the runtime
# choosing at open; "xnnpack" the standard ops only (what LiteRT-LM runs); "native" the
# custom op only (a model that opens only where the kernel builds).
ATTENTION_KERNELS = ("auto", "xnnpack", "native")
KV_CACHE_DTYPES = ("float32", "float16")
LORA_DTYPES = ("float32", "float16")
NATIVE_BUNDLE = ("--attention-kernel native with --bundle: a .litertlm bundle is for LiteRT-LM, which runs standard "
                 "ops only (it has no kernel for the runtime's custom op); export the bundle with --attention-kernel "
                 "auto (the default: the bundle gets the standard form) or xnnpack")


def precision_name(quantize: str) -> str:
    """What a file name calls a quantization's model: ``f32`` for none, else its key."""
    return "f32" if quantize == "none" else quantize


LORA_TARGETS = ("attention", "all-linear")
# The KV length an export has unless told otherwise: the model's own context, up to this. A
# session pays for the positions it has filled, not for the whole cache, where decode attention
# runs in the runtime's op (docs/kernels.md); the cache's memory is the whole length's.
MAX_DEFAULT_KV_LENGTH = 4096
# The prefill window an export with a longer cache gets unless told otherwise: prefill attends
# in standard ops over every position its signature spans, so without it a prompt's first
# chunks in a 4,096-position cache take 1.5-4.5x their time in a 1,024 one (SmolLM2-135M).
DEFAULT_PREFILL_WINDOW = 1024


def default_kv_length(context_length: int | None) -> int:
    """The KV length of an export of a model made for ``context_length`` positions (None:
    unknown) when none is asked for: that context, up to :data:`MAX_DEFAULT_KV_LENGTH`."""
    return min(context_length or MAX_DEFAULT_KV_LENGTH, MAX_DEFAULT_KV_LENGTH)


def default_prefill_windows(kv_length: int, prefill_lengths: tuple[int, ...]) -> tuple[int, ...]:
    """The prefill windows of an export that asks for none: :data:`DEFAULT_PREFILL_WINDOW`
    where the cache is longer and a prefill length fits in it, else none."""
    fits = kv_length > DEFAULT_PREFILL_WINDOW and min(prefill_lengths, default=kv_length) <= DEFAULT_PREFILL_WINDOW
    return (DEFAULT_PREFILL_WINDOW,) if fits else ()


# The prefill lengths an export has unless told otherwise: those up to half the KV length.
STANDARD_PREFILL_LENGTHS = (32, 128, 512)


def default_prefill_lengths(kv_length: int) -> tuple[int, ...]:
    """The prefill lengths for ``kv_length`` KV positions: the standard ones (32, 128, 512)
    up to half of it, so a prompt's last chunk leaves room to answer; a cache shorter than
    64 gets one prefill of half its length."""
    return tuple(length for length in STANDARD_PREFILL_LENGTHS if 2 * length <= kv_length) or (max(1, kv_length // 2),)


@dataclass(frozen=True)
class ExportSettings:
    """The shape of the exported graph.

    Signatures: ``prefill_{L}`` for each prefill length and ``decode``, plus
    ``prefill_{L}_lora_r{R}`` and ``decode_lora_r{R}`` for each LoRA rank slot R (and
    ``..._lora_all_r{R}`` beside them for all-linear LoRA targets, ``..._lora_dora_r{R}``
    for each DoRA rank); with
    batch sizes, ``decode_batch{B}_lora_r{R}`` for each batch size B and batch rank R
    (``decode_batch{B}`` when the model has no LoRA slots). Each attention window W adds
    ``decode_attend{W}[_lora_r{R}]`` and ``decode_batch{B}_attend{W}[_lora_r{R}]``: the same
    steps over a cache of W positions only (a session's first W, while its position is
    below W), which costs a fraction of attending over all ``kv_length``; with verify
    lengths also ``verify{L}_attend{W}[_lora_r{R}]``. Each prefill window W adds
    ``prefill_{L}_attend{W}[_lora_r{R}]`` for every prefill length L <= W.
    """

    # LoRA rank slots; an adapter of rank r runs in the smallest slot >= r. Empty: no LoRA.
    lora_ranks: tuple[int, ...] = ()
    # Which projections the slots take LoRA on: "attention" (q/k/v/o), or "all-linear",
    # which adds slots with the MLP's gate/up/down beside the attention-only ones (an
    # adapter touching attention only still runs the cheaper ones). None: all-linear where
    # the family supports it (Llama, Qwen2, Qwen3, Gemma 3), else attention.
    lora_targets: str | None = None
    # DoRA slots (PEFT use_dora adapters): all-linear slots of these ranks whose projections
    # also take a per-output-channel scale, with their own prefill, decode and attention-window
    # signatures ("..._lora_dora_r{R}"; Llama, Qwen2, Qwen3). Empty: none. A DoRA session runs
    # alone, never in a batched signature.
    dora_ranks: tuple[int, ...] = ()
    # KV-cache positions: the longest context a session can hold. `runtime export` gives
    # default_kv_length(the model's context) when --kv-length is not set.
    kv_length: int = MAX_DEFAULT_KV_LENGTH
    # Token counts of the prefill signatures (a prompt is cut into chunks of these); None:
    # default_prefill_lengths(kv_length), (32, 128, 512) for a KV length of 1,024 or more.
    prefill_lengths: tuple[int, ...] | None = None
    # A key of QUANTIZATIONS: "none" keeps float32 weights, "int8" is dynamic-range int8.
    quantize: str = "none"
    # "transposed": K [1, kv_heads, kv_length, head_dim], V [1, kv_heads, head_dim, kv_length]
    # (what LiteRT-LM needs; attention contracts each cache's last axis as it lies, no copy
    # transposed per step: faster decode, batched decode and prefill); "default" (litert-torch's
    # name): K and V [1, kv_length, kv_heads, head_dim]; "grouped": K and V [1, kv_heads,
    # kv_length, head_dim] (V as K lies). runtime.util.kv_layout.
    kv_layout: str = "transposed"
    # Whether prefill signatures also return logits (decode always does).
    prefill_logits: bool = False
    # Rows of the batched decode signatures: B sessions step in one pass over the weights.
    batch_sizes: tuple[int, ...] = ()
    # The LoRA rank slots the batched signatures take per row (None: every slot of
    # lora_ranks).
    batch_lora_ranks: tuple[int, ...] | None = None
    # Shorter spans of the cache that extra decode signatures attend over (each < kv_length):
    # a decode step's attention reads every position it spans, filled or not.
    attention_windows: tuple[int, ...] = ()
    # Spans of the cache that extra prefill signatures attend over (each < kv_length), for
    # the prefill lengths up to each: a chunk of T tokens ending below W attends over W
    # positions, not kv_length (a prompt's first chunks: a short prompt does not pay for
    # the whole cache). Each window costs export time like a prefill length per slot. None:
    # default_prefill_windows(kv_length, prefill_lengths), (1024,) for a longer cache.
    prefill_windows: tuple[int, ...] | None = None
    # Token counts of the verify signatures (``verify{L}[_lora_r{R}]``, one per LoRA slot
    # and one plain): L tokens at L consecutive positions returning logits and final hidden
    # states at all L, what speculative decoding with an adapter's draft heads (Turbo LoRA)
    # checks drafts with. Empty: none (such adapters then load with heads=False only).
    verify_lengths: tuple[int, ...] = ()
    # Token counts of the score signatures (``score_{L}[_lora_r{R}]``, one per LoRA slot and
    # one plain): prefills of L tokens that also return the logits at all L positions, what a
    # prompt's logprobs (the server's echo, lm-eval's loglikelihood) are read from, while the
    # plain prefills still compute no logits. Empty: none (then only prefill_logits scores).
    score_lengths: tuple[int, ...] = ()
    # A key of ATTENTION_KERNELS: "auto" adds to each .tflite the decode signatures' attention
    # as the runtime's custom op beside the standard form (transposed KV layout; a .litertlm
    # bundle, and the default layout, get the standard form only); "native" replaces the
    # standard form with it (transposed KV layout only; no .litertlm bundle); "xnnpack" neither.
    attention_kernel: str = "auto"
    # A key of KV_CACHE_DTYPES: the element type of every signature's KV caches. "float16"
    # halves the bytes a long session's attention reads per step (llama.cpp's default),
    # rows rounded to float16 once, when written (runtime.util.kv_cache_precision); the
    # graph still computes in float32. A .litertlm bundle keeps float32 caches.
    kv_cache_dtype: str = "float32"
    # A key of LORA_DTYPES: the element type of every signature's LoRA factor inputs (A and
    # B; DoRA's scales stay float32). "float16" halves what a resident adapter holds and what
    # a batch of rows with distinct adapters reads per step, the adapter's weights rounded to
    # float16 once, when loaded (runtime.util.lora_precision); the graph still computes in
    # float32. A .litertlm bundle keeps float32 factors.
    lora_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.kv_length, int) or self.kv_length < 2:
            raise InvalidArgumentError(f"kv_length={self.kv_length!r}: expected an integer >= 2")
        if self.prefill_lengths is None:  # frozen: set once, here
            object.__setattr__(self, "prefill_lengths", default_prefill_lengths(self.kv_length))
        if self.prefill_windows is None and isinstance(self.prefill_lengths, tuple):
            object.__setattr__(self, "prefill_windows", default_prefill_windows(self.kv_length, self.prefill_lengths))
        for name in ("lora_ranks", "dora_ranks", "prefill_lengths", "batch_sizes", "batch_lora_ranks",
                     "attention_windows", "prefill_windows", "verify_lengths", "score_lengths"):
            values = getattr(self, name)
            if values is None and name == "batch_lora_ranks":
                continue
            if not isinstance(values, tuple) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                        for v in values):
                raise InvalidArgumentError(f"{name}={values!r}: expected a tuple of integers")
            if any(v < 1 for v in values):
                raise InvalidArgumentError(f"{name}={values}: every value must be >= 1")
            if len(set(values)) != len(values):
                raise InvalidArgumentError(f"{name}={values}: values repeat")
        if not self.prefill_lengths:
            raise InvalidArgumentError("prefill_lengths is empty: a model needs at least one prefill length")
        too_long = [length for length in self.prefill_lengths if length > self.kv_length]
        if too_long:
            raise InvalidArgumentError(
                f"prefill_lengths {too_long} exceed kv_length={self.kv_length}: a prefill writes that many "
                "KV positions"
            )
        too_long = [window for window in self.attention_windows if window >= self.kv_length]
        if too_long:
            raise InvalidArgumentError(
                f"attention_windows {too_long} are not shorter than kv_length={self.kv_length}: decode already "
                "attends over the whole cache")
        too_long = [window for window in self.prefill_windows if window >= self.kv_length]
        if too_long:
            raise InvalidArgumentError(
                f"prefill_windows {too_long} are not shorter than kv_length={self.kv_length}: prefill already "
                "attends over the whole cache")
        too_short = [window for window in self.prefill_windows if window < min(self.prefill_lengths)]
        if too_short:
            raise InvalidArgumentError(
                f"prefill_windows {too_short} are shorter than every prefill length {sorted(self.prefill_lengths)}: "
                "a window holds at least one chunk")
        if any(length < 2 or length > self.kv_length for length in self.verify_lengths):
            raise InvalidArgumentError(f"verify_lengths={self.verify_lengths}: each must be in [2, kv_length="
                                       f"{self.kv_length}] (a verify checks the trunk's token and at least one draft)")
        if any(length < 2 or length > self.kv_length for length in self.score_lengths):
            raise InvalidArgumentError(f"score_lengths={self.score_lengths}: each must be in [2, kv_length="
                                       f"{self.kv_length}] (a single token is scored by a decode step)")
        if any(size < 2 for size in self.batch_sizes):
            raise InvalidArgumentError(f"batch_sizes={self.batch_sizes}: a batch has at least 2 rows")
        stray = sorted(set(self.batch_lora_ranks or ()) - set(self.lora_ranks))
        if stray:
            raise InvalidArgumentError(f"batch_lora_ranks {stray} are not LoRA rank slots {sorted(self.lora_ranks)}")
        if self.quantize not in QUANTIZATIONS:
            raise InvalidArgumentError(f"quantize={self.quantize!r}: expected one of {', '.join(QUANTIZATIONS)}")
        if self.lora_targets is not None and self.lora_targets not in LORA_TARGETS:
            raise InvalidArgumentError(
                f"lora_targets={self.lora_targets!r}: expected one of {', '.join(LORA_TARGETS)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise InvalidArgumentError(f"kv_layout={self.kv_layout!r}: expected one of {', '.join(KV_LAYOUTS)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise InvalidArgumentError(
                f"attention_kernel={self.attention_kernel!r}: expected one of {', '.join(ATTENTION_KERNELS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidArgumentError(
                f"kv_cache_dtype={self.kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
        if self.lora_dtype not in LORA_DTYPES:
            raise InvalidArgumentError(f"lora_dtype={self.lora_dtype!r}: expected one of {', '.join(LORA_DTYPES)}")
        if self.lora_dtype == "float16" and not (self.lora_ranks or self.dora_ranks):
            raise InvalidArgumentError("lora_dtype float16 with no LoRA slot: there are no LoRA factors to store "
                                       "(give lora_ranks or dora_ranks)")
        if self.attention_kernel == "native" and self.kv_layout not in KERNEL_KV_LAYOUTS:
            raise InvalidArgumentError(
                f"attention kernel native with kv_layout {self.kv_layout!r}: the kernel reads the transposed and "
                "grouped layouts only (K [1, G, T, D], V [1, G, D, T] or [1, G, T, D]); use kv_layout transposed or "
                "attention kernel xnnpack")

    @property
    def op_form(self) -> bool:
        """Whether the .tflite files get the decode attention's custom-op form: ``native``,
        and ``auto`` in a KV layout the kernel reads (:data:`KERNEL_KV_LAYOUTS`)."""
        return self.attention_kernel == "native" or (self.attention_kernel == "auto"
                                                     and self.kv_layout in KERNEL_KV_LAYOUTS)

    @property
    def graph_passes(self) -> bool:
        """Whether the .tflite files get a pass over their graph after quantizing: the
        attention's op form (:attr:`op_form`), float16 caches, float16 LoRA factors."""
        return self.op_form or self.kv_cache_dtype == "float16" or self.lora_dtype == "float16"

    @property
    def batch_ranks(self) -> tuple[int, ...]:
        """The rank slots of the batched decode signatures, ascending."""
        ranks = self.lora_ranks if self.batch_lora_ranks is None else self.batch_lora_ranks
        return tuple(sorted(ranks))

    @property
    def litert_quantize(self) -> str:
        """The litert-torch recipe name of :attr:`quantize`."""
        return QUANTIZATIONS[self.quantize]
