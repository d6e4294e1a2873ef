#!/usr/bin/env bash
# Runs `shop bench` with two shop binaries, alternating, on SQLite, on MariaDB ($TEST_MYSQL_URL,
# if set: both binaries share its database) and on PostgreSQL ($TEST_POSTGRES_URL; each binary
# gets a fresh database `bench_a` / `bench_b` beside it). Extra arguments after [runs] go to
# `shop bench` (e.g. `--no-postgres`).
#
#   git worktree add /tmp/old <rev> && (cd /tmp/old && CARGO_TARGET_DIR=/tmp/old-target cargo build --release -p shop)
#   cargo build --release -p shop
#   scripts/bench-compare.sh /tmp/old-target/release/shop target/release/shop [runs] [shop bench options]
set -euo pipefail
a="$(realpath "$1")" b="$(realpath "$2")" runs="${3:-2}"
shift $(($# < 3 ? $# : 3))
: "${TEST_POSTGRES_URL:?set TEST_POSTGRES_URL (. .ci/databases.sh)}"
base="${TEST_POSTGRES_URL%/*}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for run in $(seq 1 "$runs"); do
  for side in a b; do
    bin="$a"; [ "$side" = b ] && bin="$b"
    psql -q "$TEST_POSTGRES_URL" -c "DROP DATABASE IF EXISTS bench_$side" -c "CREATE DATABASE bench_$side" >/dev/null 2>&1
    echo "=== $side ($bin), run $run"
    (cd "$work" && "$bin" bench --seconds 3 --rounds 3 --postgres-url "$base/bench_$side" "$@" 2>&1 |
      grep -E "first request / unprotected|CPU s per 1,000")
  done
done
