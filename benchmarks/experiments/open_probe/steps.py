"""One model open, step by step, in this process: what each LiteRT C API call of
``NativeModel.__init__`` costs, and the memory after it.

The calls are the ones ``runtime/executor/native.py`` makes, in its order, through its
ctypes declarations (``_lib()``), each timed on its own:

    LiteRtCreateEnvironment -> LiteRtCreateModelFromBuffer -> options (CPU, XNNPACK's
    weight cache file) -> LiteRtCreateCompiledModel -> reading the signatures ->
    LiteRtDestroyModel + malloc_trim

``open_groups`` opens several compiled models in one process, each over its own view of
the same file (route b), all naming one weight cache file.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.experiments.open_probe import views


def memory() -> dict[str, float]:
    """This process's RSS, PSS, and its anonymous and file-backed parts, in MiB
    (``/proc/self/smaps_rollup``), and the page faults so far."""
    out: dict[str, float] = {}
    with open("/proc/self/smaps_rollup") as file:
        for line in file:
            parts = line.split()
            if parts[0] in ("Rss:", "Pss:", "Anonymous:", "Pss_File:", "Pss_Anon:", "Private_Dirty:"):
                out[parts[0].rstrip(":").lower()] = int(parts[1]) / 1024
    with open("/proc/self/stat") as file:
        stat = file.read().rsplit(")", 1)[1].split()
    out["minflt"], out["majflt"] = float(stat[7]), float(stat[9])
    return out


@dataclass
class Opened:
    """A compiled model opened by :func:`open_model`, with what each step took (ms)."""

    steps: dict[str, float]
    handles: dict[str, ctypes.c_void_p]
    keepalive: list[Any] = field(default_factory=list)
    signatures: int = 0

    def close(self) -> None:
        """Destroys the compiled model and its options (the model was destroyed at open)."""
        from runtime.executor.native import _lib

        lib = _lib().lib
        for name, destroy in (("compiled", lib.LiteRtDestroyCompiledModel), ("options", lib.LiteRtDestroyOptions),
                              ("model", lib.LiteRtDestroyModel), ("env", lib.LiteRtDestroyEnvironment)):
            handle = self.handles.get(name)
            if handle is not None and handle.value:
                destroy(handle)
                handle.value = None


def open_model(buffer: np.ndarray, weight_cache: str, *, num_threads: int = 1, env: ctypes.c_void_p | None = None,
               destroy_model: bool = True) -> Opened:
    """Opens ``buffer`` (a model's bytes, read in place) as ``NativeModel`` does, timing
    each call; ``env``: an environment to share (route b), else a new one."""
    from runtime.executor.native import _CPU, _CPU_OPTIONS, _P, _SIZE, _lib

    library = _lib()
    lib, check = library.lib, library.check
    steps: dict[str, float] = {}
    cpu_ms: dict[str, float] = {}
    handles: dict[str, ctypes.c_void_p] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    if env is None:
        handles["env"] = _P()
        check(lib.LiteRtCreateEnvironment(0, None, ctypes.byref(handles["env"])), "environment")
        env = handles["env"]
    steps["environment"] = time.perf_counter() - start
    model = handles["model"] = _P()
    t, c = time.perf_counter(), time.process_time()
    check(lib.LiteRtCreateModelFromBuffer(env, buffer.ctypes.data, buffer.size, ctypes.byref(model)), "model")
    steps["create_model"], cpu_ms["create_model"] = time.perf_counter() - t, time.process_time() - c
    t = time.perf_counter()
    options = handles["options"] = _P()
    check(lib.LiteRtCreateOptions(ctypes.byref(options)), "options")
    check(lib.LiteRtSetOptionsHardwareAccelerators(options, _CPU), "cpu")
    payload = (f"num_threads = {num_threads}\n" if num_threads else "") + f"weight_cache_file_path = \"{weight_cache}\"\n"
    cpu = _P()
    check(lib.LiteRtCreateOpaqueOptions(_CPU_OPTIONS, library.strdup(payload.encode()), library.free,
                                        ctypes.byref(cpu)), "cpu options")
    check(lib.LiteRtAddOpaqueOptions(options, cpu), "add options")
    steps["options"] = time.perf_counter() - t
    t, c = time.perf_counter(), time.process_time()
    compiled = handles["compiled"] = _P()
    check(lib.LiteRtCreateCompiledModel(env, model, options, ctypes.byref(compiled)), "compile")
    steps["compile"], cpu_ms["compile"] = time.perf_counter() - t, time.process_time() - c
    t = time.perf_counter()
    count = _SIZE()
    check(lib.LiteRtGetNumModelSignatures(model, ctypes.byref(count)), "signatures")
    for index in range(count.value):
        sig, key, n = _P(), ctypes.c_char_p(), _SIZE()
        check(lib.LiteRtGetModelSignature(model, index, ctypes.byref(sig)), "signature")
        check(lib.LiteRtGetSignatureKey(sig, ctypes.byref(key)), "key")
        check(lib.LiteRtGetNumSignatureInputs(sig, ctypes.byref(n)), "inputs")
    steps["signatures"] = time.perf_counter() - t
    t = time.perf_counter()
    if destroy_model:
        lib.LiteRtDestroyModel(model)
        model.value = None
        library.return_freed_memory()
    steps["destroy_model"] = time.perf_counter() - t
    steps["total"], cpu_ms["total"] = time.perf_counter() - start, time.process_time() - cpu_start
    steps.update({f"cpu_{k}": v for k, v in cpu_ms.items()})
    return Opened({k: v * 1e3 for k, v in steps.items()}, handles, [buffer], count.value)


def map_file(path: str) -> np.ndarray:
    """The file mapped read-only, as ``NativeModel`` maps a path."""
    import mmap

    with open(path, "rb") as file:
        return np.frombuffer(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)


def open_one(path: str, keys: Sequence[str] | None, weight_cache: str, num_threads: int = 1,
             runs: Sequence[str] = ()) -> dict[str, Any]:
    """Opens ``path`` (all signatures, or the view of ``keys``) once; the steps (ms), the
    view's patch time, and memory before and after; with ``runs``, each of those signatures'
    first and second run after a second open (:func:`first_runs`). ``keys`` starting with ``"sigonly"``:
    only the signature table is cut, every subgraph stays listed."""
    before = memory()
    t = time.perf_counter()
    cut = not (keys and keys[0] == "sigonly")
    keys = [k for k in keys or () if k != "sigonly"]
    view = views.subset_view(path, keys, cut_subgraphs=cut) if keys else None
    buffer = view.array if view else map_file(path)
    patch_ms = (time.perf_counter() - t) * 1e3
    opened = open_model(buffer, weight_cache, num_threads=num_threads)
    after = memory()
    result = {"steps": {"view": patch_ms, **opened.steps}, "signatures": opened.signatures,
              "memory_before": before, "memory_after": after}
    opened.close()
    if runs:
        result["runs"] = first_runs(buffer, weight_cache, runs, num_threads)
        result["memory_after_runs"] = memory()
    return result


def first_runs(buffer: np.ndarray, weight_cache: str, keys: Sequence[str], num_threads: int = 1,
               ) -> dict[str, list[float]]:
    """Opens ``buffer`` again (as ``NativeModel``) and runs each signature of ``keys`` twice
    on zeroed buffers (token 42): ms of the first run (the library allocates a signature's
    tensors on its first run) and of the second."""
    from runtime.executor.native import HostBuffer, NativeModel

    model = NativeModel(memoryview(buffer), num_threads=num_threads, weight_cache=weight_cache, name="probe")
    out: dict[str, list[float]] = {}
    for key in keys:
        sig = model.signatures[key]
        ins = {k: HostBuffer(i) for k, i in sig.inputs.items()}
        outs = {k: HostBuffer(i) for k, i in sig.outputs.items()}
        ins["tokens"].write(np.full(ins["tokens"].info.shape, 42))
        run = model.prepare(sig.index, list(ins.values()), list(outs.values()))
        out[key] = []
        for _ in range(2):
            t = time.perf_counter()
            model.run(run)
            out[key].append((time.perf_counter() - t) * 1e3)
    model.close()
    return out


def open_groups(path: str, groups: Sequence[Sequence[str]], weight_cache: str, num_threads: int = 1,
                ) -> dict[str, Any]:
    """Route b: one compiled model per group of signatures, each over its own view of
    ``path``, one environment, one weight cache file; each group's steps and the memory
    after each."""
    from runtime.executor.native import _P, _lib

    library = _lib()
    env = _P()
    library.check(library.lib.LiteRtCreateEnvironment(0, None, ctypes.byref(env)), "environment")
    out: dict[str, Any] = {"memory_before": memory(), "groups": []}
    opened = []
    for keys in groups:
        t = time.perf_counter()
        view = views.subset_view(path, keys)
        patch_ms = (time.perf_counter() - t) * 1e3
        model = open_model(view.array, weight_cache, num_threads=num_threads, env=env)
        opened.append(model)
        out["groups"].append({"keys": list(keys), "steps": {"view": patch_ms, **model.steps},
                              "memory_after": memory()})
    for model in opened:
        model.close()
    library.lib.LiteRtDestroyEnvironment(env)
    return out


def pid_rss() -> float:
    """This process's RSS in MiB."""
    return memory()["rss"] if os.path.exists("/proc/self/smaps_rollup") else 0.0
