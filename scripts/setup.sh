#!/usr/bin/env bash
# One idempotent setup for a fresh machine (and a no-op on a ready one):
#   1. Debian packages the build needs (cmake, clang for bindgen, OpenBLAS, g++ for mx.compile),
#   2. the runtime + oracle env at .venv/ (MLX runtime wheel, mlx, mlx-lm; pinned in versions.env),
#   3. Debian's OpenBLAS in place of the wheel's netlib reference BLAS, for mlxb and both oracles,
#   4. mlx-sys / mlx-rs materialized from the crates.io registry into .crates/ with our patches.
# With --dev (the test suite's setup) also: headless Chromium and chromedriver for the chat
# page's browser test, and the L2 oracle env at .venv-optiq/ (the same MLX stack plus
# mlx-optiq, whose transformers pin differs from mlx-lm's env).
# Nothing third-party is committed; everything here is fetched from package registries.
set -euo pipefail

dev=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    *) printf '[setup] error: unknown option %s (the only one is --dev)\n' "$arg" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=versions.env
source scripts/versions.env
runtime_wheel=${MLXB_RUNTIME_WHEEL:-$MLXB_RUNTIME_WHEEL_DEFAULT}

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 2; }

hash_of() { cat "$@" | sha256sum | cut -c1-16; }

install_debian_packages() {
  [ "$(uname -s)" = Linux ] || return 0
  command -v dpkg >/dev/null || { say "not a Debian system: install cmake, clang/libclang, pkg-config, g++, OpenBLAS (and Chromium with chromedriver for the browser test) yourself"; return 0; }
  local wanted=(cmake clang libclang-dev pkg-config g++ libopenblas0-pthread patch)
  if [ "$dev" = 1 ]; then wanted+=(chromium chromium-driver); fi
  local missing=()
  for p in "${wanted[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing Debian packages: ${missing[*]}"
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

setup_venv() {
  local stamp=.venv/.mlxb-stamp
  local want
  want="$MLX_VERSION $runtime_wheel $MLX_LM_VERSION $(hash_of scripts/requirements-oracle.txt)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  say "creating .venv (mlx==$MLX_VERSION, $runtime_wheel==$MLX_VERSION, mlx-lm==$MLX_LM_VERSION)"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check \
    "mlx==$MLX_VERSION" "$runtime_wheel==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION" \
    -r scripts/requirements-oracle.txt
  echo "$want" >"$stamp"
}

setup_optiq_venv() {
  local stamp=.venv-optiq/.mlxb-stamp
  local want="$MLX_VERSION $runtime_wheel $MLX_LM_VERSION $MLX_OPTIQ_VERSION"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  say "creating .venv-optiq (the L2 oracle: mlx-optiq==$MLX_OPTIQ_VERSION on the same MLX stack)"
  [ -x .venv-optiq/bin/python ] || python3 -m venv .venv-optiq
  .venv-optiq/bin/pip install -q --disable-pip-version-check \
    "mlx==$MLX_VERSION" "$runtime_wheel==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION" \
    "mlx-optiq==$MLX_OPTIQ_VERSION"
  echo "$want" >"$stamp"
}

# The CPU wheel's libmlx.so finds its BLAS through RPATH $ORIGIN/../../mlx_cpu.libs; pointing
# that file at OpenBLAS makes Python mlx and mlxb (which links the same libmlx.so) use it. The
# L2 oracle env gets the same swap: a KV cache quantized from keys that differ in the last bit
# can land in another bin, so both sides must compute with the same BLAS.
swap_in_openblas() {
  local venv=$1
  [ "$runtime_wheel" = mlx-cpu ] || return 0
  [ "$(uname -s)" = Linux ] || return 0
  [ -e "$OPENBLAS_LIB" ] || die "OpenBLAS not found at $OPENBLAS_LIB (Debian package libopenblas0-pthread)"
  local libs
  libs=$("$venv/bin/python" -c "import mlx, os; print(os.path.join(os.path.dirname(mlx.__path__[0]), 'mlx_cpu.libs'))")
  local blas
  for blas in "$libs"/libblas-*.so.*; do
    case "$blas" in *.netlib) continue ;; esac
    if [ -L "$blas" ] && [ "$(readlink "$blas")" = "$OPENBLAS_LIB" ]; then continue; fi
    say "pointing $(basename "$blas") at OpenBLAS"
    [ -e "$blas.netlib" ] || mv "$blas" "$blas.netlib"
    ln -sfn "$OPENBLAS_LIB" "$blas"
  done
}

materialize_crates() {
  local stamp=.crates/.mlxb-stamp
  local want
  want="$MLX_SYS_VERSION $MLX_RS_VERSION $(hash_of patches/*/*.patch)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  say "materializing mlx-sys $MLX_SYS_VERSION and mlx-rs $MLX_RS_VERSION from crates.io with our patches"
  local fetch=.cache/crate-fetch
  rm -rf "$fetch" && mkdir -p "$fetch/src"
  printf '[package]\nname = "crate-fetch"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nmlx-sys = { version = "=%s", default-features = false }\nmlx-rs = { version = "=%s", default-features = false }\n' \
    "$MLX_SYS_VERSION" "$MLX_RS_VERSION" >"$fetch/Cargo.toml"
  echo 'fn main() {}' >"$fetch/src/main.rs"
  (cd "$fetch" && cargo fetch -q)
  local cargo_home=${CARGO_HOME:-$HOME/.cargo}
  rm -rf .crates && mkdir -p .crates
  local name version file
  for spec in "mlx-sys:$MLX_SYS_VERSION" "mlx-rs:$MLX_RS_VERSION"; do
    name=${spec%%:*}; version=${spec#*:}
    file=$(ls "$cargo_home"/registry/cache/*/"$name-$version.crate" 2>/dev/null | head -n1)
    [ -n "$file" ] || die "cargo fetch did not leave $name-$version.crate in $cargo_home/registry/cache"
    tar -xzf "$file" -C .crates
    mv ".crates/$name-$version" ".crates/$name"
    for p in patches/"$name"/*.patch; do
      patch -s -p1 -d ".crates/$name" <"$p" || die "patch $p does not apply to $name $version"
    done
  done
  echo "$want" >"$stamp"
}

install_debian_packages
setup_venv
swap_in_openblas .venv
if [ "$dev" = 1 ]; then
  setup_optiq_venv
  swap_in_openblas .venv-optiq
fi
materialize_crates
if [ "$dev" = 1 ]; then
  say "ready: $runtime_wheel $MLX_VERSION in .venv, the L2 oracle in .venv-optiq, Chromium, patched crates in .crates"
else
  say "ready: $runtime_wheel $MLX_VERSION in .venv, patched crates in .crates (scripts/setup.sh --dev adds what the tests need)"
fi
