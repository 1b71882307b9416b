#!/usr/bin/env bash
# A pinned llama.cpp, built from PyPI material: the llama.cpp vendored in the `llama-cpp-python==$VERSION` sdist
# (it has the DFLASH/DSpark draft arch and `--spec-type draft-dspark`), CPU, Release, native flags. Builds
# llama-server, llama-cli and llama-speculative-simple into
#   ${XDG_CACHE_HOME:-~/.cache}/dspark-sgl/llama.cpp-$VERSION/build/bin
# keeps the source next to it (src/: convert_hf_to_gguf.py, gguf-py) with the converter's one extra dependency
# (pydeps/: sentencepiece), and reuses all of it when present (prints the folder and exits). Nothing of llama.cpp
# enters this repository. The build's wall times (download, configure, compile) and the machine go to
# build/build.json (benchmarks/results/llamacpp_build.json is one such record; docs/llamacpp.md).
#   usage: nice -n 10 benchmarks/llamacpp/build.sh            (make llamacpp)
#          benchmarks/llamacpp/build.sh --source              the source and pydeps only (the converter), no build
# Env: JOBS (default: nproc), PYTHON (a python whose pip reaches PyPI; default python3), LLAMACPP_DIR (the folder).
set -euo pipefail
VERSION=0.3.36
DIR=${LLAMACPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dspark-sgl/llama.cpp-$VERSION}
JOBS=${JOBS:-$(nproc)}
PYTHON=${PYTHON:-python3}
TARGETS=(llama-server llama-cli llama-speculative-simple)
SOURCE_ONLY=0
[[ ${1:-} == --source ]] && SOURCE_ONLY=1

if [[ $SOURCE_ONLY == 0 && -f $DIR/build/.complete ]]; then
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
if [[ ! -d $DIR/pydeps/sentencepiece ]]; then
  "$PYTHON" -m pip install --quiet --target "$DIR/pydeps" "sentencepiece>=0.1.98,<0.3.0"
fi
t_source=$((SECONDS - t0))
if [[ $SOURCE_ONLY == 1 ]]; then
  echo "llama.cpp $VERSION source: $DIR/src (converter: $DIR/src/convert_hf_to_gguf.py, PYTHONPATH=$DIR/pydeps)"
  exit 0
fi
generator=()
if command -v ninja > /dev/null; then generator=(-G Ninja); fi
# Static libraries: the binaries work from the cache folder alone. No UI, no HTTPS, no network at build time.
cmake -S "$DIR/src" -B "$DIR/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF > "$DIR/cmake-configure.log"
t_configure=$((SECONDS - t0 - t_source))
cmake --build "$DIR/build" -j "$JOBS" --target "${TARGETS[@]}"
for t in "${TARGETS[@]}"; do test -x "$DIR/build/bin/$t"; done
t_total=$((SECONDS - t0))
cpu=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
cat > "$DIR/build/build.json" <<JSON
{
 "what": "llama.cpp from the llama-cpp-python==$VERSION sdist: ${TARGETS[*]} (CMake Release, GGML_NATIVE=ON, static)",
 "cpu": "$cpu",
 "cores": $(nproc),
 "jobs": $JOBS,
 "load_avg_1m_at_end": "$(cut -d' ' -f1 /proc/loadavg)",
 "generator": "${generator[*]:-default}",
 "compiler": "$(c++ --version | head -1)",
 "cmake": "$(cmake --version | head -1)",
 "date_utc": "$(date -u '+%Y-%m-%d %H:%M')",
 "seconds": {"source_and_pydeps": $t_source, "configure": $t_configure, "compile": $((t_total - t_source - t_configure)), "total": $t_total}
}
JSON
echo "built in $t_total s (source $t_source s, configure $t_configure s, compile $((t_total - t_source - t_configure)) s) on $(nproc) cores, JOBS=$JOBS" | tee "$DIR/build/.complete"
echo "llama.cpp $VERSION: $DIR/build/bin (record: $DIR/build/build.json)"
