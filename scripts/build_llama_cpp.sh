#!/usr/bin/env bash
# Builds llama.cpp's llama-bench and llama-quantize for `mlxb bench --baseline llama.cpp`, from
# the llama.cpp vendored in the llama-cpp-python sdist on PyPI (pinned in versions.env), CPU
# backend with this machine's instruction set (GGML_NATIVE). About 8 minutes on two cores.
# Installs into mlxb's cache directory ($XDG_CACHE_HOME/mlxb or ~/.cache/mlxb)/llama.cpp/bin,
# where `mlxb bench` looks by default; idempotent (a built copy of the same version is kept).
#
# The same weights as a GGUF for llama-bench: the registry GGUF mlxb imported, or
# llama-quantize's F32/BF16 of it, e.g. for the default model (imported from Q4_1):
#   ~/.cache/mlxb/llama.cpp/bin/llama-quantize --allow-requantize Q4_1.gguf F32.gguf F32
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=versions.env
source "$root/scripts/versions.env"
cache=${XDG_CACHE_HOME:-$HOME/.cache}/mlxb/llama.cpp
version=$LLAMA_CPP_PYTHON_VERSION
build_id="$version native-no-amx"

say() { printf '[llama.cpp] %s\n' "$*" >&2; }
die() { printf '[llama.cpp] error: %s\n' "$*" >&2; exit 2; }

if [ -x "$cache/bin/llama-bench" ] && [ "$(cat "$cache/VERSION" 2>/dev/null)" = "$build_id" ]; then
  say "llama-bench of llama-cpp-python $version is already built: $cache/bin/llama-bench"
  exit 0
fi
command -v cmake >/dev/null || die "cmake is missing: run scripts/setup.sh (it installs cmake and g++)"
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

say "fetching the llama-cpp-python $version sdist from PyPI"
"$python" -m pip download --quiet --no-deps --no-binary :all: --dest "$work" \
  "llama-cpp-python==$version" || die "cannot download llama-cpp-python==$version from PyPI"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || die "the sdist has no vendored llama.cpp at vendor/llama.cpp"

say "building llama-bench and llama-quantize (GGML_NATIVE, CPU backend)"
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DBUILD_SHARED_LIBS=OFF >"$work/cmake.log" 2>&1 || { tail -20 "$work/cmake.log" >&2; die "cmake configure failed"; }
cmake --build "$work/build" --target llama-bench llama-quantize -j "$(nproc)" >"$work/build.log" 2>&1 \
  || { tail -20 "$work/build.log" >&2; die "the build failed"; }

mkdir -p "$cache/bin"
for b in llama-bench llama-quantize; do
  install -m 755 "$work/build/bin/$b" "$cache/bin/$b.tmp"
  mv "$cache/bin/$b.tmp" "$cache/bin/$b"
done
echo "$build_id" >"$cache/VERSION"
say "built: $cache/bin/llama-bench"
