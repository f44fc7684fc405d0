#!/usr/bin/env bash
# Prepares a Linux machine to build sluice with `--features mlx` against MLX's CPU backend:
#   1. libclang (bindgen reads the mlx-c headers),
#   2. the mlx-cpu wheel, unpacked into .mlx/ (a prebuilt libmlx.so and its headers; no Python at run time),
#   3. the mlx-c sources, which ship inside the crates.io package mlx-sys 0.7.0 (fetched into cargo's registry),
#   4. .cargo/config.toml: the stand-in mlx-sys-linux/ in place of crates.io mlx-sys, and MLX_PREFIX.
# Idempotent. On macOS nothing is needed: `cargo build --features mlx` uses upstream mlx-sys and Metal.
set -euo pipefail
cd "$(dirname "$0")/.."
MLX_VERSION=0.32.2 # the MLX that mlx-c 0.7.0 (mlx-sys 0.7.0) was written against

if [ "$(uname -s)" != Linux ]; then
  echo "setup-mlx.sh is for Linux; on macOS just build with --features mlx" >&2
  exit 1
fi

if ! ls /usr/lib/llvm-*/lib/libclang*.so >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libclang-dev >/dev/null
fi

if [ ! -f .mlx/mlx/lib/libmlx.so ]; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-pip >/dev/null
  fi
  rm -rf .mlx && mkdir -p .mlx/wheel
  python3 -m pip download -q --no-deps --only-binary=:all: \
    "mlx-cpu==$MLX_VERSION" -d .mlx/wheel
  python3 -m zipfile -e .mlx/wheel/mlx_cpu-*.whl .mlx/
fi

cargo_home="${CARGO_HOME:-$HOME/.cargo}"
if ! ls "$cargo_home"/registry/src/*/mlx-sys-0.7.0/src/mlx-c/mlx/c/mlx.h >/dev/null 2>&1; then
  scratch="$(mktemp -d)"
  mkdir -p "$scratch/src" && touch "$scratch/src/lib.rs"
  printf '[package]\nname = "fetch-mlx-c"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nmlx-sys = "=0.7.0"\n' \
    >"$scratch/Cargo.toml"
  (cd "$scratch" && cargo fetch -q)
  rm -rf "$scratch"
fi

mkdir -p .cargo
cat >.cargo/config.toml <<TOML
# Written by scripts/setup-mlx.sh (Linux only; not committed).
[patch.crates-io]
mlx-sys = { path = "mlx-sys-linux" }

[env]
MLX_PREFIX = { value = ".mlx/mlx", relative = true }
TOML
echo "mlx backend ready: cargo build --release -p sluice --features mlx" >&2
