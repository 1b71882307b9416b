#!/usr/bin/env bash
# A pinned llama.cpp, built from PyPI material: the llama.cpp vendored in the `llama-cpp-python==$VERSION` sdist
# (it has the DFLASH/DSpark draft arch and `--spec-type draft-dspark`), CPU, Release, native flags. Builds
# llama-server, llama-cli and llama-speculative-simple into
#   ${XDG_CACHE_HOME:-~/.cache}/dspark-sgl/llama.cpp-$VERSION/build/bin
# keeps the source next to it (src/: convert_hf_to_gguf.py, gguf-py) with the converter's one extra dependency
# (pydeps/: sentencepiece), and reuses all of it when present (prints the folder and exits). Nothing of llama.cpp
# enters this repository.
#   usage: nice -n 10 benchmarks/llamacpp/build.sh     (~40 min on 2 shared cores; docs/llamacpp.md)
# Env: JOBS (default 2), PYTHON (a python whose pip reaches PyPI; default python3), LLAMACPP_DIR (the folder).
set -euo pipefail
VERSION=0.3.36
DIR=${LLAMACPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dspark-sgl/llama.cpp-$VERSION}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3}
TARGETS=(llama-server llama-cli llama-speculative-simple)

if [[ -f $DIR/build/.complete ]]; then
  echo "llama.cpp $VERSION already built: $DIR/build/bin ($(cat "$DIR/build/.complete"))"
  exit 0
fi
mkdir -p "$DIR"
t0=$SECONDS
if [[ ! -f $DIR/src/CMakeLists.txt ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
  tar -xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp" "llama_cpp_python-$VERSION/vendor/llama.cpp"
  rm -rf "$DIR/src"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR/src"
fi
# convert_hf_to_gguf.py imports sentencepiece even for BPE tokenizers; torch/transformers come from the caller's env.
"$PYTHON" -m pip install --quiet --target "$DIR/pydeps" "sentencepiece>=0.1.98,<0.3.0"
generator=()
if command -v ninja > /dev/null; then generator=(-G Ninja); fi
# Static libraries: the binaries work from the cache folder alone. No UI, no HTTPS, no network at build time.
cmake -S "$DIR/src" -B "$DIR/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF > "$DIR/cmake-configure.log"
cmake --build "$DIR/build" -j "$JOBS" --target "${TARGETS[@]}"
for t in "${TARGETS[@]}"; do test -x "$DIR/build/bin/$t"; done
echo "built in $((SECONDS - t0)) s on $(nproc) cores, JOBS=$JOBS" | tee "$DIR/build/.complete"
echo "llama.cpp $VERSION: $DIR/build/bin"
