"""(The probe's own registration, kept as measured; the runtime's is runtime/executor/kernels.)

Custom-op kernels given to LiteRT through its C API from Python (ai-edge-litert 2.3's
``libLiteRt.so``): ``LiteRtAddCustomOpKernelOption(options, name, version, &kernel,
user_data)``, the kernel a struct of four C function pointers (``Init``,
``GetOutputLayouts``, ``Run``, ``Destroy``) copied by value into the options.

How the library calls them (its ``CustomOpDispatcher``): one dispatcher per registered
name, shared by every node of that name in every signature; ``Init(user_data, custom
options, size)`` per node; ``GetOutputLayouts(user_data, n_in, in_layouts, n_out,
out_layouts)`` at prepare, whose layouts it resizes the outputs to (so it must fill them);
``Run(user_data, n_in, inputs, n_out, outputs)`` per invoke with ``LiteRtTensorBuffer``
handles it creates for the node's tensors for that call (the signature's own buffers where
the tensor is a signature input or output). The node is not passed to Run: per-node
attributes have to travel as inputs (a constant tensor), not custom options.

``install(kernels)`` registers kernels on every compiled model created while it is active
by wrapping ``LiteRtCreateCompiledModel`` on the library object ``runtime.executor.native``
uses, so the models are opened by ``NativeModel`` itself: the same environment, options,
CPU accelerator, XNNPACK options, buffers and runs as the runtime's.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass

_P = ctypes.c_void_p


class KernelStruct(ctypes.Structure):
    """``LiteRtCustomOpKernel``: four function pointers."""

    _fields_ = [("init", _P), ("get_output_layouts", _P), ("run", _P), ("destroy", _P)]


@dataclass
class Kernel:
    """A custom op's implementation: the name the model's CUSTOM op carries, its four
    callbacks' addresses, the user data passed to each, and whatever keeps them alive."""

    name: str
    init: int
    get_output_layouts: int
    run: int
    destroy: int
    user_data: int = 0
    keep: object = None  # the cfuncs / library / scratch the addresses point into


class CustomOpError(Exception):
    """A model's custom op that cannot run: no kernel, or a node the kernel would misread."""


@dataclass(frozen=True)
class CustomNode:
    """A CUSTOM op of the model: its code, and its inputs' shapes (None: unranked)."""

    subgraph: int
    index: int
    code: str
    inputs: tuple


def custom_nodes(model: int) -> list[CustomNode]:
    """Every CUSTOM op of a ``LiteRtModel`` handle, read through the C API (before it is
    compiled: ``NativeModel`` destroys the model after)."""
    from runtime.executor import native

    lib = native._lib().lib
    size, handle, text = ctypes.c_size_t(), _P(), ctypes.c_char_p()
    for name, argtypes in (("LiteRtGetNumModelSubgraphs", [_P, ctypes.POINTER(ctypes.c_size_t)]),
                           ("LiteRtGetModelSubgraph", [_P, ctypes.c_size_t, ctypes.POINTER(_P)]),
                           ("LiteRtGetNumSubgraphOps", [_P, ctypes.POINTER(ctypes.c_size_t)]),
                           ("LiteRtGetSubgraphOp", [_P, ctypes.c_size_t, ctypes.POINTER(_P)]),
                           ("LiteRtGetCustomCode", [_P, ctypes.POINTER(ctypes.c_char_p)]),
                           ("LiteRtGetNumOpInputs", [_P, ctypes.POINTER(ctypes.c_size_t)]),
                           ("LiteRtGetOpInput", [_P, ctypes.c_size_t, ctypes.POINTER(_P)])):
        function = getattr(lib, name)
        function.restype, function.argtypes = ctypes.c_int, argtypes
    raw = ctypes.create_string_buffer(256)
    nodes = []
    lib.LiteRtGetNumModelSubgraphs(model, ctypes.byref(size))
    for g in range(size.value):
        subgraph, ops = _P(), ctypes.c_size_t()
        lib.LiteRtGetModelSubgraph(model, g, ctypes.byref(subgraph))
        lib.LiteRtGetNumSubgraphOps(subgraph, ctypes.byref(ops))
        for i in range(ops.value):
            op = _P()
            lib.LiteRtGetSubgraphOp(subgraph, i, ctypes.byref(op))
            if lib.LiteRtGetCustomCode(op, ctypes.byref(text)):  # an error: not a custom op
                continue
            count, shapes = ctypes.c_size_t(), []
            lib.LiteRtGetNumOpInputs(op, ctypes.byref(count))
            for j in range(count.value):
                lib.LiteRtGetOpInput(op, j, ctypes.byref(handle))
                if lib.LiteRtGetRankedTensorType(handle, raw):
                    shapes.append(None)
                    continue
                rank = raw.raw[4] & 0x7F
                shapes.append(tuple(int.from_bytes(raw.raw[8 + 4 * k:12 + 4 * k], "little", signed=True)
                                    for k in range(rank)))
            nodes.append(CustomNode(g, i, text.value.decode(), tuple(shapes)))
    return nodes


def check_attention_node(node: CustomNode) -> str | None:
    """Why the attention kernel would misread this node, or None."""
    shapes = node.inputs
    if len(shapes) < 5 or (len(shapes) - 3) % 2 or any(s is None for s in shapes):
        return f"{len(shapes)} inputs (expected q, input_pos, params, then K and V per row)"
    q, pos, params, k, v = shapes[:5]
    if len(q) != 4 or (len(shapes) - 3) // 2 != q[0]:
        return f"q {q} for {(len(shapes) - 3) // 2} rows of caches"
    if pos != (q[0],) or params != (4,):
        return f"input_pos {pos} / params {params} (expected ({q[0]},) and (4,))"
    for r in range(q[0]):
        k, v = shapes[3 + 2 * r], shapes[4 + 2 * r]
        if len(k) != 4 or k[1] != q[1] or k[3] != q[3] or v != (1, k[1], k[3], k[2]):
            return f"row {r}: K {k}, V {v} for q {q} (expected K [1, G, T, D], V [1, G, D, T])"
    return None


CHECKS = {"odml_runtime.decode_attention": check_attention_node}


@contextlib.contextmanager
def install(kernels: list[Kernel], check: bool = True):
    """Every ``NativeModel`` opened inside this block gets ``kernels`` registered; with
    ``check``, a model whose custom op has no kernel, or a node the kernel's check refuses,
    is refused at open (``CustomOpError`` naming the op), never left to fail at a run."""
    from runtime.executor import native

    from runtime.executor import kernels as product_kernels

    lib = native._lib()
    add = lib.lib.LiteRtAddCustomOpKernelOption
    declared = add.restype, add.argtypes  # the runtime's own declaration, restored after the block
    add.restype, add.argtypes = ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(KernelStruct), _P]
    # The runtime now registers its own kernel (runtime/executor/kernels) for models with custom ops and
    # refuses ops it does not know: inside this block the probe's kernels are registered instead.
    product_attach = product_kernels.attach
    product_kernels.attach = lambda *args, **kwargs: None
    real = lib.lib.LiteRtCreateCompiledModel
    names = [k.name.encode() for k in kernels]  # kept alive for the block
    known = {k.name for k in kernels}

    def create(env, model, options, out):
        if check:
            for node in custom_nodes(model):
                if node.code not in known:
                    raise CustomOpError(f"custom op {node.code!r} (subgraph {node.subgraph}, op {node.index}) has no "
                                        "kernel registered")
                problem = CHECKS.get(node.code, lambda n: None)(node)
                if problem:
                    raise CustomOpError(f"custom op {node.code!r} (subgraph {node.subgraph}, op {node.index}): {problem}")
        for kernel, name in zip(kernels, names):
            struct = KernelStruct(kernel.init, kernel.get_output_layouts, kernel.run, kernel.destroy)
            status = add(options, name, 1, ctypes.byref(struct), kernel.user_data)
            if status:
                return status
        return real(env, model, options, out)

    lib.lib.LiteRtCreateCompiledModel = create
    try:
        yield
    finally:
        lib.lib.LiteRtCreateCompiledModel = real
        add.restype, add.argtypes = declared
        product_kernels.attach = product_attach


def litert_path() -> str:
    """The wheel's ``libLiteRt.so``."""
    from pathlib import Path

    import ai_edge_litert
    return str(Path(ai_edge_litert.__file__).parent / "libLiteRt.so")
