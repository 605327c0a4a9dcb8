"""The ``.tflite`` pass behind ``--attention-kernel native``: each layer's decode attention
in the decode signatures becomes one custom op, ``odml_runtime.decode_attention``, whose
kernel :mod:`runtime.executor.kernels` builds and registers when the model opens.

What it rewrites, in every signature whose key starts with ``decode`` (single-row and
batched: a batched signature has one chain per row and layer), in the transposed KV
layout (K ``[1, G, T, D]``, V ``[1, G, D, T]``)::

    BATCH_MATMUL(q, K, adj_y) -> [RESHAPE] -> ADD(mask) -> [RESHAPE] -> SOFTMAX -> BATCH_MATMUL(p, V, adj_y)

or the grouped one (K and V ``[1, G, T, D]``: the last matmul ``BATCH_MATMUL(p, V)``, no
``adj_y``), becomes ``odml_runtime.decode_attention(q, mask, params, K, V)``, params a constant
``[1, 0, layout, 0]`` (scale on q.k: the exports scale q before; no logit soft-cap; V's layout,
0 transposed or 1 grouped, which the matmul's ``adj_y`` tells even where the shapes cannot, at
``T == D``). The mask is the graph's own additive mask for the step (causal, sliding window,
attention window alike), so the op computes what the chain computed, and reads only the
cache positions the mask leaves open. Any other op between the two matmuls (a soft-cap, a
scale) is refused, naming it: the chain is never half-understood.

The same subgraphs' LoRA deltas, ``BATCH_MATMUL(x, A) -> BATCH_MATMUL(h, B)`` whose right
operands are the signature's adapter inputs (which XNNPACK packs again at every step),
become ``odml_runtime.lora_delta(x, A, B)`` (:func:`_rewrite_lora`), matched as strictly:
a matmul by an adapter input in any other arrangement is refused, naming it. And each
float32 ``FULLY_CONNECTED`` of theirs becomes ``odml_runtime.linear_rows(x, W)``
(:func:`_rewrite_linear`), which reads each weight once for a batch's 8 rows where XNNPACK's
float32 GEMM takes 7 a pass, and computes a row alone as in a batch; one of another form (a
bias, an activation, quantized weights) stays as it is, which computes the same.

Two ways to write it (:func:`rewrite_decode_attention`):

* **both forms** (``keep_standard``, ``--attention-kernel auto``, the export's default): every
  signature keeps its standard subgraph, and each rewritten decode subgraph gets an op-form
  copy appended after all the model's subgraphs, which no signature names. The copy shares
  the standard subgraph's tensor tables and unchanged operator tables (one flatbuffer table
  each, referenced from both), and every weight buffer: the file grows by the new operators
  and the two subgraph vectors, not by the weights. A metadata entry
  (:data:`FORMS_METADATA`) pairs each standard subgraph with its op form.
  :func:`runtime.util.model_view.select_attention_form` then makes, in place and in a few bytes, the view a runtime
  opens: the op forms in the standard subgraphs' places, or the standard forms alone; either
  way the op-form subgraphs are cut off the subgraph vector, so LiteRT never compiles the
  form not chosen, and a reader that knows nothing of this (LiteRT-LM, the classic
  interpreter) runs the standard form.
* **the op form only** (``--attention-kernel native``): the decode subgraphs rewritten in place.

The model is rewritten through the wheel's flatbuffer schema (object API,
:mod:`runtime.util.flatbuffer_model`: buffers aligned, models of 2 GB and more refused).
"""

from __future__ import annotations

import json

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from runtime.errors import InvalidArgumentError
from runtime.util import flatbuffer_model
from runtime.util.graph_edit import FLOAT16, FLOAT32, op_name

DECODE_ATTENTION = "odml_runtime.decode_attention"
# The op form's LoRA deltas (:func:`_rewrite_lora`): BATCH_MATMUL(x, A) -> BATCH_MATMUL(h, B).
LORA_DELTA = "odml_runtime.lora_delta"
# The op form's float32 linear layers over a batch's rows (:func:`_rewrite_linear`).
LINEAR_ROWS = "odml_runtime.linear_rows"
# Every op of ours the op form may run.
OUR_OPS = (DECODE_ATTENTION, LORA_DELTA, LINEAR_ROWS)
# The metadata entry of a model carrying both forms: its buffer holds JSON,
# {"op": DECODE_ATTENTION, "subgraphs": [[standard subgraph, its op form], ...]}.
FORMS_METADATA = "odml_runtime.attention_forms"


def custom_codes(model: bytes | memoryview | np.ndarray) -> set[str]:
    """The custom op codes a ``.tflite``'s bytes name (its operator table only: cheap)."""
    root = schema.Model.GetRootAs(model, 0)
    codes = set()
    for i in range(root.OperatorCodesLength()):
        code = root.OperatorCodes(i)
        if max(code.BuiltinCode(), code.DeprecatedBuiltinCode()) == schema.BuiltinOperator.CUSTOM:
            codes.add((code.CustomCode() or b"").decode(errors="replace"))
    return codes


def _shape(sub: schema.SubGraphT, index: int) -> tuple[int, ...]:
    return tuple(int(d) for d in sub.tensors[index].shape)


def _adj_y(op: schema.OperatorT) -> bool:
    options = op.builtinOptions
    return bool(options is not None and getattr(options, "adjY", False) and not getattr(options, "adjX", False))


def rewrite_decode_attention(data: bytes, *, keep_standard: bool = False) -> tuple[bytes, dict[str, int]]:
    """``data`` (a ``.tflite``) with the decode signatures' attention rewritten
    (:func:`rewrite_attention`); and the layers rewritten per signature."""
    model = flatbuffer_model.unpack(data)
    counts = rewrite_attention(model, keep_standard=keep_standard)
    return flatbuffer_model.pack(model), counts


def rewrite_attention(model: schema.ModelT, *, keep_standard: bool = False) -> dict[str, int]:
    """Rewrites ``model`` (a ``.tflite`` in object form, :mod:`runtime.util.flatbuffer_model`)
    in place: the decode signatures' attention as the custom op; the layers rewritten per
    signature. ``keep_standard``: both forms in the file (the op forms appended, sharing every
    weight and tensor; see the module), else the op form only. Caches in float16
    (:mod:`runtime.util.kv_cache_precision`, run before) are read by the op as they are.
    ``InvalidArgumentError`` when the model cannot be rewritten (no decode signature in the
    transposed layout, an attention chain of another form, already rewritten), naming why."""
    if runs_our_ops(model):
        raise InvalidArgumentError(f"the model already runs one of {', '.join(OUR_OPS)}")
    keys = [sig.signatureKey.decode() for sig in model.signatureDefs or () if sig.signatureKey.startswith(b"decode")]
    if not keys:
        raise InvalidArgumentError("the model has no decode signature to rewrite")
    custom_code = _custom_code(model, DECODE_ATTENTION)
    params_buffers: dict[bool, int] = {}  # by V's layout (grouped or not): the op's params, once per model
    counts = {}
    done_subgraphs: dict[int, int] = {}
    pairs: dict[int, int] = {}  # standard subgraph -> its op form (keep_standard)
    for sig in model.signatureDefs:
        key = sig.signatureKey.decode()
        if key not in keys:
            continue
        index = sig.subgraphIndex
        if index not in done_subgraphs:
            standard = model.subgraphs[index]
            target = _shallow_copy(standard) if keep_standard else standard
            done_subgraphs[index] = _rewrite_subgraph(model, target, key, custom_code, params_buffers)
            if keep_standard and done_subgraphs[index]:
                model.subgraphs.append(target)
                pairs[index] = len(model.subgraphs) - 1
        counts[key] = done_subgraphs[index]
    if not any(counts.values()):
        raise InvalidArgumentError("no decode attention in the transposed or grouped KV layout was found (K [1, G, "
                                   "T, D], V [1, G, D, T] or [1, G, T, D]): export with --kv-layout transposed")
    if keep_standard:
        forms = schema.BufferT()
        forms.data = np.frombuffer(json.dumps({"op": DECODE_ATTENTION, "subgraphs": sorted(pairs.items())}).encode(),
                                   np.uint8)
        model.buffers.append(forms)
        entry = schema.MetadataT()
        entry.name, entry.buffer = FORMS_METADATA, len(model.buffers) - 1
        model.metadata = [*(model.metadata or ()), entry]
    return counts


def standard_form_only(model: schema.ModelT) -> bool:
    """Makes ``model`` (object form) of both forms a model of its standard form alone, in
    place: the op-form subgraphs, their pairing metadata and the ops' codes removed, so
    that :func:`rewrite_attention` can make the op form again (with this version's pass,
    or after :mod:`runtime.util.kv_cache_precision`). Whether it carried both forms.
    ``InvalidArgumentError`` for a model whose op form replaced the standard one (nothing
    to go back to: re-export it)."""
    entry = next((e for e in model.metadata or () if e.name in (FORMS_METADATA, FORMS_METADATA.encode())), None)
    if entry is None:
        if any(_ours(code) for code in model.operatorCodes or ()):
            raise InvalidArgumentError(f"the model runs {DECODE_ATTENTION} in place of the standard form "
                                       "(--attention-kernel native): re-export it")
        return False
    pairs = json.loads(bytes(np.asarray(model.buffers[entry.buffer].data, np.uint8)))["subgraphs"]
    model.subgraphs = model.subgraphs[:min(op for _, op in pairs)]
    model.metadata = [e for e in model.metadata if e is not entry]
    kept = [i for i, code in enumerate(model.operatorCodes) if not _ours(code)]
    renumbered = {old: new for new, old in enumerate(kept)}
    model.operatorCodes = [model.operatorCodes[i] for i in kept]
    for sub in model.subgraphs:
        for op in sub.operators:
            if op.opcodeIndex not in renumbered:
                raise InvalidArgumentError(f"a standard subgraph runs one of {', '.join(OUR_OPS)}: "
                                           "not a file of both forms as the export writes it")
            op.opcodeIndex = renumbered[op.opcodeIndex]
    return True


def runs_our_ops(model: schema.ModelT) -> bool:
    """Whether ``model`` (object form) runs any of :data:`OUR_OPS` (the passes that store
    inputs in float16 run before the op form is made)."""
    return any(_ours(code) for code in model.operatorCodes or ())


def _ours(code: schema.OperatorCodeT) -> bool:
    """Whether an operator code is one of :data:`OUR_OPS` (str where appended here, bytes where read)."""
    name = code.customCode.decode(errors="replace") if isinstance(code.customCode, bytes) else code.customCode
    return name in OUR_OPS


def _shallow_copy(sub: schema.SubGraphT) -> schema.SubGraphT:
    """A subgraph with the same tensor and operator objects in lists of its own (packed
    once each, :func:`_pack`, so both subgraphs refer to the same tables)."""
    copy = schema.SubGraphT()
    copy.tensors, copy.operators = list(sub.tensors), list(sub.operators)
    copy.inputs, copy.outputs = sub.inputs, sub.outputs
    copy.name = (sub.name or b"") + b"__" + DECODE_ATTENTION.encode()
    copy.debugMetadataIndex = sub.debugMetadataIndex
    return copy


def attention_forms(model: bytes | memoryview | np.ndarray) -> dict[int, int]:
    """The op form of each standard subgraph a model carrying both forms pairs (``{}``: the
    model carries one form). ``InvalidArgumentError`` when the entry is not as
    :func:`rewrite_decode_attention` writes it. Bytes that do not read as a ``.tflite`` give
    ``{}`` (LiteRT refuses them when they are loaded, naming its reason)."""
    try:
        data = flatbuffer_model.metadata_bytes(model, FORMS_METADATA)
    except flatbuffer_model.READ_ERRORS:
        return {}
    if data is None:
        return {}
    where = f"its {FORMS_METADATA} metadata"
    try:
        described = json.loads(bytes(data))
        pairs = {int(standard): int(op) for standard, op in described["subgraphs"]}
        op, count = described.get("op"), schema.Model.GetRootAs(model, 0).SubgraphsLength()
    except (*flatbuffer_model.READ_ERRORS, KeyError, AttributeError) as exc:
        raise InvalidArgumentError(f"{where} does not read as pairs of subgraphs ({exc})") from None
    if op != DECODE_ATTENTION:
        raise InvalidArgumentError(f"{where} names the op {op!r}, this runtime has {DECODE_ATTENTION!r}")
    first_op = min(pairs.values(), default=0)
    if not pairs or max(pairs) >= first_op or max(pairs.values()) >= count \
            or sorted(pairs.values()) != list(range(first_op, count)):
        raise InvalidArgumentError(f"{where} pairs subgraphs {sorted(pairs.items())} of {count}: expected "
                                   "the op forms to be the last subgraphs, one per standard one")
    return pairs


def _stored(model: schema.ModelT, sub: schema.SubGraphT, index: int, consumers: dict[int, list[int]],
            producers: dict[int, int]) -> tuple[int, int | None]:
    """The tensor an op reads for the matmul operand ``index``: a float16 one's (a KV cache,
    a LoRA factor), where ``index`` is its conversion to float32 read by that matmul alone,
    with the converting op (which the op form drops); else ``index`` itself and None."""
    j = producers.get(index)
    if j is None or len(consumers.get(index, ())) != 1 or op_name(model, sub.operators[j]) != "DEQUANTIZE":
        return index, None
    source = int(sub.operators[j].inputs[0])
    return (source, j) if sub.tensors[source].type == FLOAT16 else (index, None)


def _params(model: schema.ModelT, sub: schema.SubGraphT, grouped: bool, buffers: dict[bool, int],
            tensors: dict[bool, int]) -> int:
    """The op's params tensor in ``sub`` for V's layout (``grouped`` or transposed): appended to
    ``sub`` (``tensors``: this subgraph's, by layout) over a buffer appended to ``model`` once
    (``buffers``), where missing."""
    if grouped not in buffers:
        params = schema.BufferT()
        params.data = np.frombuffer(np.array([1.0, 0.0, float(grouped), 0.0], np.float32).tobytes(), np.uint8)
        model.buffers.append(params)
        buffers[grouped] = len(model.buffers) - 1
    if grouped not in tensors:
        tensor = schema.TensorT()
        tensor.name, tensor.shape, tensor.type, tensor.buffer = b"odml_runtime_attention_params", [4], FLOAT32, \
            buffers[grouped]
        sub.tensors.append(tensor)
        tensors[grouped] = len(sub.tensors) - 1
    return tensors[grouped]


def _rewrite_subgraph(model: schema.ModelT, sub: schema.SubGraphT, key: str, custom_code: int,
                      params_buffers: dict[bool, int]) -> int:
    """Rewrites ``sub`` (the subgraph of signature ``key``) in place: its operators list
    replaced, a params tensor appended (:func:`_params`); the tensor and operator objects it
    shares with another subgraph left as they are. The number of layers rewritten."""
    outputs = set(int(i) for i in sub.outputs)
    consumers: dict[int, list[int]] = {}
    producers: dict[int, int] = {}
    for j, op in enumerate(sub.operators):
        for i in op.inputs:
            consumers.setdefault(int(i), []).append(j)
        for i in op.outputs:
            producers[int(i)] = j
    params_tensors: dict[bool, int] = {}
    drop, replace = set(), {}
    for j, op in enumerate(sub.operators):
        if op_name(model, op) != "BATCH_MATMUL" or b"kv_cache_k" not in (sub.tensors[op.inputs[1]].name or b""):
            continue
        where = f"{key}: the attention at op {j}"
        q_index, k_index = int(op.inputs[0]), int(op.inputs[1])
        q, k = _shape(sub, q_index), _shape(sub, k_index)
        if len(k) != 4 or len(q) != 4 or q[0] != 1 or k[0] != 1 or (q[1], q[3]) != (k[1], k[3]) or not _adj_y(op):
            raise InvalidArgumentError(f"{where}: q {list(q)} by K {list(k)} is not the transposed or grouped "
                                       "layout's decode attention (export with --kv-layout transposed)")
        span = k[2]
        chain, at, mask = [j], j, None
        while True:
            produced = int(sub.operators[at].outputs[0])
            following = consumers.get(produced, [])
            if len(following) != 1 or produced in outputs:
                raise InvalidArgumentError(f"{where}: an intermediate result is used elsewhere")
            at = following[0]
            chain.append(at)
            step = sub.operators[at]
            name = op_name(model, step)
            if name == "BATCH_MATMUL":
                break
            if name == "ADD" and mask is None:
                other = [int(i) for i in step.inputs if int(i) != produced]
                if len(other) != 1 or sub.tensors[other[0]].type != FLOAT32 \
                        or int(np.prod(_shape(sub, other[0]))) != span or _shape(sub, other[0])[-1:] != (span,):
                    raise InvalidArgumentError(f"{where}: the ADD after q.K is not a mask of {span} positions")
                mask = other[0]
            elif name == "SOFTMAX":
                if step.builtinOptions is not None and getattr(step.builtinOptions, "beta", 1.0) != 1.0:
                    raise InvalidArgumentError(f"{where}: a SOFTMAX with beta {step.builtinOptions.beta}")
            elif name != "RESHAPE":
                raise InvalidArgumentError(f"{where}: op {name} between the attention's matmuls is not one the "
                                           f"kernel computes (use --attention-kernel xnnpack)")
            if _shape(sub, int(step.outputs[0]))[-1:] != (span,):
                raise InvalidArgumentError(f"{where}: {name} moves the positions axis")
        last = sub.operators[chain[-1]]
        v_index = int(last.inputs[1])
        softmax = [i for i in chain if op_name(model, sub.operators[i]) == "SOFTMAX"]
        if mask is None or len(softmax) != 1 or _shape(sub, int(sub.operators[softmax[0]].outputs[0])) \
                != _shape(sub, int(op.outputs[0])) or int(last.inputs[0]) != int(sub.operators[softmax[0]].outputs[0]):
            raise InvalidArgumentError(f"{where}: not BATCH_MATMUL -> ADD mask -> SOFTMAX -> BATCH_MATMUL")
        grouped = not _adj_y(last)  # V [1, G, T, D] read as it lies, else [1, G, D, T] transposed by the matmul
        if b"kv_cache_v" not in (sub.tensors[v_index].name or b"") or _shape(sub, int(last.outputs[0])) != q \
                or _shape(sub, v_index) != ((1, k[1], span, k[3]) if grouped else (1, k[1], k[3], span)):
            raise InvalidArgumentError(f"{where}: the second matmul is not by the V cache [1, G, D, T] (with adj_y) "
                                       "or [1, G, T, D] (without)")
        if any(sub.tensors[i].type != FLOAT32 for i in (q_index, k_index, v_index, int(last.outputs[0]))):
            raise InvalidArgumentError(f"{where}: not float32")
        (k_cache, k_convert), (v_cache, v_convert) = (_stored(model, sub, i, consumers, producers)
                                                      for i in (k_index, v_index))
        custom = schema.OperatorT()
        custom.opcodeIndex = custom_code
        custom.inputs = [q_index, mask, _params(model, sub, grouped, params_buffers, params_tensors), k_cache, v_cache]
        custom.outputs = [int(last.outputs[0])]
        custom.customOptionsFormat = schema.CustomOptionsFormat.FLEXBUFFERS
        drop.update(chain[:-1])
        drop.update(j for j in (k_convert, v_convert) if j is not None)
        replace[chain[-1]] = custom
    sub.operators = [replace.get(j, op) for j, op in enumerate(sub.operators) if j not in drop]
    _rewrite_lora(model, sub, key)
    _rewrite_linear(model, sub)
    return len(replace)


def _custom_code(model: schema.ModelT, name: str) -> int:
    """The index of the custom op code ``name`` in ``model``, appended where missing."""
    for i, code in enumerate(model.operatorCodes):
        if code.customCode in (name, name.encode()):  # str where appended here, bytes where read
            return i
    code = schema.OperatorCodeT()
    code.builtinCode, code.deprecatedBuiltinCode = schema.BuiltinOperator.CUSTOM, schema.BuiltinOperator.CUSTOM
    code.customCode, code.version = name, 1
    model.operatorCodes.append(code)
    return len(model.operatorCodes) - 1


def _rewrite_lora(model: schema.ModelT, sub: schema.SubGraphT, key: str) -> None:
    """Rewrites in place each LoRA delta of ``sub`` (signature ``key``), the pair
    ``BATCH_MATMUL(x, A) -> BATCH_MATMUL(h, B)`` whose right operands are the signature's
    adapter inputs (``..._a_prime_weight_L`` [in, r] or [N, in, r], and its ``_b_`` twin
    [r, out] or [N, r, out]), as one ``odml_runtime.lora_delta(x, A, B)``: XNNPACK packs
    such dynamic operands again at every step, the op reads them as they are (float16
    factors too, without their conversion to float32). A matmul by
    an adapter input that is not such a pair (transposed, h read elsewhere, other shapes or
    types) is refused, naming it."""
    inputs = set(int(i) for i in sub.inputs)
    outputs = set(int(i) for i in sub.outputs)
    consumers: dict[int, list[int]] = {}
    producers: dict[int, int] = {}
    for j, op in enumerate(sub.operators):
        for i in op.inputs:
            consumers.setdefault(int(i), []).append(j)
        for i in op.outputs:
            producers[int(i)] = j

    def factor(index: int) -> tuple[int, int | None]:
        """The adapter input a matmul operand reads: float16 factors (lora_precision) through
        the DEQUANTIZE this matmul alone reads, which the op form drops (with it)."""
        source, convert = _stored(model, sub, index, consumers, producers)
        return (source, convert) if source in inputs else (index, None)

    adapter = lambda index: index in inputs and b"_a_prime_weight" in (sub.tensors[index].name or b"")  # noqa: E731
    code, drop, replace = None, set(), {}
    for j, op in enumerate(sub.operators):
        if op_name(model, op) != "BATCH_MATMUL" or len(op.inputs) != 2:
            continue
        a_index, a_convert = factor(int(op.inputs[1]))
        if not adapter(a_index):
            continue
        x_index, h_index = int(op.inputs[0]), int(op.outputs[0])
        a_name = sub.tensors[a_index].name
        where = f"{key}: the LoRA delta at op {j} ({a_name.decode(errors='replace')})"
        following = consumers.get(h_index, [])
        if len(following) != 1 or h_index in outputs:
            raise InvalidArgumentError(f"{where}: x.A is read elsewhere than by one matmul")
        second = sub.operators[following[0]]
        b_index, b_convert = factor(int(second.inputs[1])) if len(second.inputs) == 2 else (-1, None)
        if op_name(model, second) != "BATCH_MATMUL" or int(second.inputs[0]) != h_index or b_index not in inputs \
                or sub.tensors[b_index].name != a_name.replace(b"_a_prime_weight", b"_b_prime_weight"):
            raise InvalidArgumentError(f"{where}: x.A is not multiplied by its B input next")
        if any(o.builtinOptions is not None and (getattr(o.builtinOptions, "adjX", False)
                                                  or getattr(o.builtinOptions, "adjY", False)) for o in (op, second)):
            raise InvalidArgumentError(f"{where}: a transposed operand")
        out_index = int(second.outputs[0])
        if any(sub.tensors[i].type != FLOAT32 for i in (x_index, h_index, out_index)) \
                or sub.tensors[a_index].type != sub.tensors[b_index].type \
                or sub.tensors[a_index].type not in (FLOAT32, FLOAT16):
            raise InvalidArgumentError(f"{where}: not float32 (A and B: both float32 or both float16)")
        x, a, b, h, out = (_shape(sub, i) for i in (x_index, a_index, b_index, h_index, out_index))
        batched = len(a) == 3 and len(x) == 3 and a[0] == x[0] and b[:1] == (x[0],)
        if not (len(a) == 2 or batched) or len(b) != len(a) or a[-2] != x[-1] or b[-2] != a[-1] \
                or h != (*x[:-1], a[-1]) or out != (*x[:-1], b[-1]):
            raise InvalidArgumentError(f"{where}: x {list(x)} by A {list(a)} by B {list(b)} is not "
                                       "[..., in] by [in, r] by [r, out] (or [N, M, in] by [N, in, r] by [N, r, out])")
        if code is None:
            code = _custom_code(model, LORA_DELTA)
        custom = schema.OperatorT()
        custom.opcodeIndex = code
        custom.inputs, custom.outputs = [x_index, a_index, b_index], [out_index]
        custom.customOptionsFormat = schema.CustomOptionsFormat.FLEXBUFFERS
        drop.add(j)
        drop.update(k for k in (a_convert, b_convert) if k is not None)
        replace[following[0]] = custom
    sub.operators = [replace.get(j, op) for j, op in enumerate(sub.operators) if j not in drop]


def _rewrite_linear(model: schema.ModelT, sub: schema.SubGraphT) -> None:
    """Replaces in place each ``FULLY_CONNECTED`` of ``sub`` whose input, weights and output
    are float32, whose weights are constant (unquantized, ``[N, K]``) and which has no bias
    and no fused activation, by ``odml_runtime.linear_rows(x, W)``, which computes the same
    product reading W once for up to 8 rows (linear_rows.c). Single rows too: the kernel
    computes a row alone exactly as in a batch (XNNPACK's GEMM does too, but the two differ
    from each other by float32 sums in another order), and is as fast there (SmolLM2 f32, one
    session: 0.95x XNNPACK's step). A linear of another form keeps XNNPACK."""
    code = None
    for j, op in enumerate(sub.operators):
        if op_name(model, op) != "FULLY_CONNECTED" or len(op.inputs) < 2 or (len(op.inputs) > 2 and op.inputs[2] >= 0):
            continue
        options = op.builtinOptions
        if options is not None and getattr(options, "fusedActivationFunction", 0):
            continue
        x_index, w_index, out_index = int(op.inputs[0]), int(op.inputs[1]), int(op.outputs[0])
        x, w, out = (_shape(sub, i) for i in (x_index, w_index, out_index))
        weights = sub.tensors[w_index]
        stored = model.buffers[weights.buffer].data if 0 < weights.buffer < len(model.buffers) else None
        constant = stored is not None and len(stored) > 0
        if not constant or weights.quantization is not None and weights.quantization.scale is not None \
                or any(sub.tensors[i].type != FLOAT32 for i in (x_index, w_index, out_index)) \
                or len(w) != 2 or not x or x[-1] != w[1] or out != (*x[:-1], w[0]):
            continue
        if code is None:
            code = _custom_code(model, LINEAR_ROWS)
        custom = schema.OperatorT()
        custom.opcodeIndex = code
        custom.inputs, custom.outputs = [x_index, w_index], [out_index]
        custom.customOptionsFormat = schema.CustomOptionsFormat.FLEXBUFFERS
        sub.operators[j] = custom
