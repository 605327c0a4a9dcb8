#!/usr/bin/env bash
# llama.cpp's llama-server, for the llama.cpp half of benchmarks/serve_load.py.
#
#   bash benchmarks/llama_cpp/build_server.sh
#
# 1. Unpacks llama.cpp from the same llama-cpp-python sdist as setup.sh (downloaded into
#    $LLAMA_CPP_SRC, default benchmarks/llama_cpp/src/, gitignored, if missing).
# 2. Builds only the llama-server target: CPU, no curl/OpenSSL, AMX compiled out (see
#    setup.sh: its kernels die with SIGILL on this kind of VM). ~25 min on 2 busy cores.
#    The binary is linked as $LLAMA_CPP_SRC/bin/llama-server, where serve_load.py looks.
# 3. Converts the bench model and its PEFT adapters to GGUF in benchmarks/models/gguf/
#    (gitignored) unless they are there (setup.sh makes the same files), with
#    $BUILD_PYTHON (default python3; needs torch, transformers, safetensors, sentencepiece).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VERSION=0.3.36
SRC=${LLAMA_CPP_SRC:-$HERE/src}
TREE=$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp
MODELS=$ROOT/benchmarks/models
GGUF=$MODELS/gguf
BUILD_PYTHON=${BUILD_PYTHON:-python3}
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

log() { printf '[build_server %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

mkdir -p "$SRC"
if [ ! -f "$TREE/tools/server/CMakeLists.txt" ]; then
    if [ ! -f "$SRC/llama_cpp_python-$VERSION.tar.gz" ]; then
        log "downloading the llama-cpp-python $VERSION sdist"
        python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
    fi
    tar -xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC" "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi

if [ ! -x "$TREE/build/bin/llama-server" ]; then
    log "building llama-server (several minutes)"
    start=$(date +%s)
    cmake -S "$TREE" -B "$TREE/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
        -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
        > "$SRC/cmake-configure.log"
    nice -n 10 cmake --build "$TREE/build" --target llama-server -j "$(nproc)" > "$SRC/cmake-build.log"
    log "built in $(( $(date +%s) - start )) s"
fi
mkdir -p "$SRC/bin"
ln -sf "$TREE/build/bin/llama-server" "$SRC/bin/llama-server"
log "llama-server: $SRC/bin/llama-server"

mkdir -p "$GGUF"
convert() {  # convert() OUT CONVERTER ARGS...: runs a vendored converter unless OUT exists
    local out=$1; shift
    [ -f "$out" ] && return 0
    log "converting -> ${out#$ROOT/}"
    (cd "$TREE" && "$BUILD_PYTHON" "$@" --outfile "$out" > "$out.log" 2>&1) || { tail -20 "$out.log"; exit 1; }
}
convert "$GGUF/bench-f32.gguf" convert_hf_to_gguf.py --outtype f32 "$MODELS/hf"
for adapter in peft_r8_a peft_r8_b peft_r64; do
    convert "$GGUF/lora-$adapter-f32.gguf" convert_lora_to_gguf.py --outtype f32 --base "$MODELS/hf" "$MODELS/$adapter"
done
log "done; run: python3 -m benchmarks.serve_load"
