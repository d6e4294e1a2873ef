#!/usr/bin/env bash
# The shop's resident memory under a long storm (issue 16, item 4).
#
#   bash bench/rss.sh [SECONDS] [DATABASE_URL]
#
# Starts one `shop` process (release build; the embedded SQLite default in a temporary folder
# unless DATABASE_URL is given), drives it with back-to-back `shop storm --url …` rounds (48
# users, 18 operations each, 4 copies of every request, providers failing and slow) for SECONDS
# (default 600), and samples the process's VmRSS (and its anonymous, file and shared parts) from
# /proc every 5 s. Prints every sample, then the RSS after the first minute (warm-up), the peak,
# the growth from the second minute to the last minute, and the slope after warm-up (a
# least-squares fit, MB per 10 minutes). SHOP_ARGS adds flags to the shop, e.g.
# SHOP_ARGS=--heap-trim-ms=0 for glibc's default behaviour.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
work=$(mktemp -d /tmp/shop-rss.XXXX)
url=${2:-sqlite://$work/shop.db}
port=${RSS_PORT:-18181}
shop=target/release/shop
[ -x "$shop" ] || cargo build --release -p shop >&2

"$shop" --listen "127.0.0.1:$port" --database-url "$url" ${SHOP_ARGS:-} \
    --payment-latency-ms 5 --payment-fail-rate 0.1 --mail-fail-rate 0.05 >"$work/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do grep -q listening "$work/serve.log" && break; sleep 0.1; done
grep -q listening "$work/serve.log" || { cat "$work/serve.log"; exit 1; }

storms=0
failed=0
start=$(date +%s)
(
    while [ $(( $(date +%s) - start )) -lt "$seconds" ]; do
        if "$shop" storm --url "http://127.0.0.1:$port" --quiet >"$work/storm.log" 2>&1 \
            && grep -q "invariants: OK" "$work/storm.log"; then
            echo ok
        else
            echo failed; cp "$work/storm.log" "$work/failed-storm.log"
        fi
    done >"$work/storms"
) &
driver=$!

: >"$work/samples"
while kill -0 $driver 2>/dev/null; do
    elapsed=$(( $(date +%s) - start ))
    # VmRSS, then its parts: anonymous (the heap), file-backed, shared (SQLite's -shm).
    kb=$(awk '/^(VmRSS|RssAnon|RssFile|RssShmem):/ {printf "%s ", $2}' "/proc/$pid/status")
    echo "$elapsed $kb" | tee -a "$work/samples"
    sleep 5
done
wait $driver || true
storms=$(grep -c ok "$work/storms" || true)
failed=$(grep -c failed "$work/storms" || true)
kill -0 $pid || { echo "the shop died"; cat "$work/serve.log"; exit 1; }

awk -v storms="$storms" -v failed="$failed" -v seconds="$seconds" '
    { t[NR] = $1; kb[NR] = $2; if ($2 > peak) peak = $2 }
    END {
        for (i = 1; i <= NR; i++) {
            if (t[i] >= 60 && !warm) warm = kb[i]
            if (t[i] >= 60 && t[i] < 120) { s2 += kb[i]; n2++ }
            if (t[i] >= t[NR] - 60) { sl += kb[i]; nl++ }
            if (t[i] >= 60) { n++; sx += t[i]; sy += kb[i]; sxx += t[i] * t[i]; sxy += t[i] * kb[i] }
        }
        if (!n2) n2 = 1
        if (!nl) nl = 1
        slope = (n > 1) ? (n * sxy - sx * sy) / (n * sxx - sx * sx) : 0
        printf "rss: %d s, %d storms (%d failed invariants), %d samples\n", seconds, storms, failed, NR
        printf "rss: after warm-up (60 s) %.1f MB; peak %.1f MB; second minute mean %.1f MB; last minute mean %.1f MB; growth %+.1f MB\n", \
            warm / 1024, peak / 1024, s2 / n2 / 1024, sl / nl / 1024, (sl / nl - s2 / n2) / 1024
        printf "rss: slope after warm-up %+.2f MB per 10 min\n", slope * 600 / 1024
    }' "$work/samples"
[ "$failed" -eq 0 ]
