#!/usr/bin/env bash
# The users' platforms, checked from an x86-64 Linux machine (CI runs this after the README's test command):
#   1. macOS (aarch64-apple-darwin): clippy with every target (lib, bins, tests, benches) and -D warnings,
#      which type-checks the platform module's macOS code; then the same with `--features mlx` through the
#      mlx-sys stand-in's check-only mode (bindings, no C++ build: there is no macOS linker here).
#   2. aarch64 Linux: the expert store's and the runtime's tests (unit, golden, streaming, checkpoint, pipeline,
#      kernel property tests, int8 kernels), built for aarch64-unknown-linux-gnu and run under
#      `qemu-aarch64 -cpu max`, so every NEON feature the kernels may probe for is present.
# Usage: scripts/cross-check.sh [macos|aarch64|all] (default all). Installs what it needs (rustup targets,
# Debian's qemu-user and the aarch64 cross gcc) when missing. Any failure fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"

sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
apt_install() {
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

if [ "$what" = macos ] || [ "$what" = all ]; then
  rustup target add aarch64-apple-darwin >/dev/null
  echo "== macOS (aarch64-apple-darwin): clippy --workspace --all-targets -D warnings" >&2
  cargo clippy --workspace --all-targets --target aarch64-apple-darwin -- -D warnings
  echo "== macOS with --features mlx (mlx-sys stand-in, check-only)" >&2
  ./scripts/setup-mlx.sh
  cargo clippy -p sluice-runtime -p sluice --all-targets --features mlx --target aarch64-apple-darwin -- -D warnings
fi

if [ "$what" = aarch64 ] || [ "$what" = all ]; then
  rustup target add aarch64-unknown-linux-gnu >/dev/null
  if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
    apt_install qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross
  fi
  export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
  export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
  export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu max -L /usr/aarch64-linux-gnu"
  echo "== aarch64 Linux under qemu: expert-store and runtime tests" >&2
  # Every test but the trained models' held-out perplexity sweeps (57k token-forwards each: ~10 min emulated;
  # the int8 one runs the float kernels there anyway); they run natively on x86-64 in the README's test command.
  # Of the damaged-input walks (`mutations.rs`), the tokenizer one (~1,700 loads of the tokenizers crate's parser)
  # and the config one (~1,100 configs through the same validation) take ~3 and ~1 minutes under qemu and have
  # no platform code of their own; they run natively in the README's test command. The tensor, file and store
  # walks, which read through the platform's I/O, run here too.
  cargo test -p expert-store -p sluice-runtime --target aarch64-unknown-linux-gnu -- \
    --skip eval_perplexity_matches_mlx_lm_at_each_top_k --skip trained_perplexity_stays_within_half_a_percent \
    --skip every_tokenizer_and_index_field_damaged_loads_or_fails_cleanly \
    --skip every_config_field_damaged_loads_or_fails_cleanly
fi
