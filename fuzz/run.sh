#!/usr/bin/env bash
# Runs every fuzz target for a bounded time (seconds, default 60 each) with cargo-fuzz on the
# stable toolchain (RUSTC_BOOTSTRAP lets it pass the sanitizer flags). Installs cargo-fuzz if
# missing. Fails if a target finds a crash.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-60}"
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked --quiet
export RUSTC_BOOTSTRAP=1
echo "fuzz: building targets"
cargo fuzz build
for target in $(cargo fuzz list); do
  mkdir -p "corpus/$target"
  extra=()
  [ -d "seeds/$target" ] && extra+=("seeds/$target")
  echo "fuzz: $target for ${seconds}s"
  cargo fuzz run "$target" "corpus/$target" "${extra[@]}" -- \
    -max_total_time="$seconds" -dict=json.dict -print_final_stats=1 2>&1 \
    | grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|Done|==|SUMMARY|thread|panicked)' || true
  # cargo fuzz exits non-zero on a crash; with pipefail the pipeline above would hide it, so
  # check for artifacts explicitly.
  if ls "artifacts/$target"/crash-* >/dev/null 2>&1; then
    echo "fuzz: $target found a crash:"; ls "artifacts/$target"; exit 1
  fi
done
