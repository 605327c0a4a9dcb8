#!/usr/bin/env bash
# llama.cpp for the runtime-vs-llama.cpp benchmark, kept out of the project's dependencies.
#
#   bash benchmarks/llama_cpp/setup.sh
#
# 1. Creates benchmarks/llama_cpp/.venv (gitignored) and pip-installs
#    llama-cpp-python==0.3.36 into it. That compiles llama.cpp from the sdist: a CPU-only
#    native build, ~6-9 min on 2 cores. Skipped when that version is already installed
#    (LLAMA_CPP_REBUILD=1 forces it).
#    AMX is compiled out (-mno-amx-*): on this kind of VM the CPU reports AMX, and
#    llama.cpp's AMX kernels (used for q8_0 weights, batches > 1) die with SIGILL
#    (`tilezero`) inside llama_decode.
# 2. If benchmarks/models/hf is missing, builds every benchmark model with
#    tools/build_bench_models.py (needs the build virtualenv, ~7 min).
# 3. Downloads the llama-cpp-python sdist (benchmarks/llama_cpp/src/, gitignored) and
#    unpacks only its vendored converters (vendor/llama.cpp/convert_*.py, conversion/,
#    gguf-py/).
# 4. prepare_models.py, for each model set of files.py whose checkpoint is there:
#      bench (benchmarks/models/, into models/gguf/, gitignored):
#        hf/ -> bench-f32.gguf, bench-q8_0.gguf; peft_r8_a/ -> lora-peft_r8_a-f32.gguf
#        (and peft_r8_b, peft_r64)
#      smollm2 (real size, in $RUNTIME_CACHE or ~/.cache/runtime, under bench/smollm2/):
#        random PEFT adapters of rank 8, 8, 64 and 256 on the cached checkpoint
#        (models/smollm2-135m-instruct-hf), its f32 and q8_0 GGUF, the adapters' GGUF.
#      A set whose checkpoint is missing is skipped, naming the command that makes it
#      (smollm2: python3 tools/train_smollm2_adapters.py prepare).
#    It and the converters run with python3, which needs the export extra (torch,
#    transformers, peft, sentencepiece); BUILD_PYTHON to override.
#
# Then: benchmarks/llama_cpp/.venv/bin/python benchmarks/llama_cpp/bench_llama_cpp.py
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VERSION=0.3.36
VENV=$HERE/.venv
SRC=$HERE/src
MODELS=$ROOT/benchmarks/models
GGUF=$MODELS/gguf
PYTHON=${PYTHON:-python3}
BUILD_PYTHON=${BUILD_PYTHON:-python3}  # needs the export extra (torch, transformers): pip install -e ".[export]"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# --- 1. llama-cpp-python in its own virtualenv -------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
installed=$("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null || true)
if [ "$installed" != "$VERSION" ] || [ "${LLAMA_CPP_REBUILD:-0}" = 1 ]; then
    log "pip install llama-cpp-python==$VERSION (compiles llama.cpp, several minutes)"
    start=$(date +%s)
    # --no-cache-dir: a cached wheel would ignore CMAKE_ARGS.
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$VENV/bin/pip" install --no-cache-dir --force-reinstall "llama-cpp-python==$VERSION"
    log "llama-cpp-python built and installed in $(( $(date +%s) - start )) s"
else
    log "llama-cpp-python $VERSION already installed in $VENV"
fi
if "$VENV/bin/python" -c 'import llama_cpp, sys; sys.exit("AMX_INT8 = 1" not in llama_cpp.llama_print_system_info().decode())'; then
    log "warning: this llama.cpp build has AMX kernels; q8_0 prefill may die with SIGILL (LLAMA_CPP_REBUILD=1 to rebuild)"
fi

# --- 2. the benchmark models (HF checkpoint, PEFT adapters, .tflite) ---------------------
if [ ! -f "$MODELS/hf/model.safetensors" ]; then
    log "benchmarks/models/hf missing: building the benchmark models"
    "$BUILD_PYTHON" "$ROOT/tools/build_bench_models.py"
fi

# --- 3. the vendored converters, and the GGUF files ---------------------------------------
CONV=$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp
if [ ! -f "$CONV/convert_hf_to_gguf.py" ]; then
    mkdir -p "$SRC"
    if [ ! -f "$SRC/llama_cpp_python-$VERSION.tar.gz" ]; then
        log "downloading the llama-cpp-python $VERSION sdist (for its converters)"
        "$VENV/bin/pip" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
    fi
    tar -xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC" --wildcards \
        "llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" \
        "llama_cpp_python-$VERSION/vendor/llama.cpp/convert_lora_to_gguf.py" \
        "llama_cpp_python-$VERSION/vendor/llama.cpp/conversion/*" \
        "llama_cpp_python-$VERSION/vendor/llama.cpp/gguf-py/*" \
        "llama_cpp_python-$VERSION/vendor/llama.cpp/LICENSE"
fi

# --- 4. GGUF files and adapters of every model set (prepare_models.py; see files.py) ---------
"$BUILD_PYTHON" "$HERE/prepare_models.py" --converters "$CONV"
log "done; run: $VENV/bin/python $HERE/bench_llama_cpp.py"
