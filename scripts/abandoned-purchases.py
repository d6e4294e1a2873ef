#!/usr/bin/env python3
"""The experiment of issue 12: clients that send a purchase once and never come back.

Starts `shop` on a fresh SQLite database with its defaults plus `--payment-fail-rate 0.5
--lease-ms 1000` (the rate and the provider's latency can be changed), sends N purchases (default 20), each exactly once with its own key, never
retried, then waits (at most 90 s) until every charge at the payment provider belongs to a paid
order or has been refunded, and no purchase key is left pending. No retry, no operator action:
only the shop's own maintenance worker runs.

    cargo build --release -p shop
    python3 scripts/abandoned-purchases.py [--shop-bin target/release/shop] [--purchases 20]
    # harsher: most provider calls fail, and clients give up before the provider answers
    python3 scripts/abandoned-purchases.py --payment-fail-rate 0.9 --payment-latency-ms 200 --client-timeout-s 0.1

Prints the answers, then the state once settled (or at the deadline); exits 1 if a charge is
left without a paid or refunded order, or a key is left pending, after the deadline.
"""

import argparse
import collections
import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

ORPHANS = """
SELECT COUNT(*) FROM p.payment_provider_charges c
WHERE NOT EXISTS (SELECT 1 FROM p.payment_provider_refunds r WHERE r.charge_id = c.charge_id)
  AND NOT EXISTS (SELECT 1 FROM shop_orders o WHERE o.charge_id = c.charge_id AND o.status = 'paid')
"""


def post(url, user, key, body, timeout):
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"X-User-Id": user, "Idempotency-Key": key, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (TimeoutError, urllib.error.URLError):
        return "gave up"


def state(db_path):
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    try:
        db.execute("ATTACH DATABASE ? AS p", (f"{db_path}.providers",))
        row = lambda sql: db.execute(sql).fetchone()[0]
        return {
            "charges": row("SELECT COUNT(*) FROM p.payment_provider_charges"),
            "refunds": row("SELECT COUNT(*) FROM p.payment_provider_refunds"),
            "paid orders": row("SELECT COUNT(*) FROM shop_orders WHERE status = 'paid'"),
            "cancelled orders": row("SELECT COUNT(*) FROM shop_orders WHERE status = 'cancelled'"),
            "pending keys": row("SELECT COUNT(*) FROM idempotency_keys WHERE state = 'pending'"),
            "keys needing review": row(
                "SELECT COUNT(*) FROM idempotency_keys WHERE state = 'needs_review'"
            ),
            "charges without a paid or refunded order": row(ORPHANS),
        }
    finally:
        db.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shop-bin", default="target/release/shop")
    parser.add_argument("--purchases", type=int, default=20)
    parser.add_argument("--deadline-s", type=float, default=90)
    parser.add_argument("--payment-fail-rate", default="0.5")
    parser.add_argument("--payment-latency-ms", default="0")
    parser.add_argument(
        "--client-timeout-s", type=float, default=30,
        help="a client gives up (and never retries) after this long",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as work:
        db_path = os.path.join(work, "shop.db")
        shop = subprocess.Popen(
            [
                os.path.abspath(args.shop_bin),
                "--database-url", f"sqlite://{db_path}",
                "--listen", "127.0.0.1:0",
                "--payment-fail-rate", args.payment_fail_rate,
                "--payment-latency-ms", args.payment_latency_ms,
                "--lease-ms", "1000",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            base = None
            for line in shop.stdout:
                found = re.search(r"shop listening on (\S+)", line)
                if found:
                    base = found.group(1).rstrip("/")
                    break
            if base is None:
                sys.exit("shop did not start")

            answers = collections.Counter()
            for n in range(args.purchases):
                status = post(f"{base}/purchases", "alice", str(uuid.uuid4()), {"sku": "tea", "quantity": 1}, args.client_timeout_s)
                answers[str(status)] += 1
            print("answers (each purchase sent once, never retried):", dict(sorted(answers.items())))
            sent = time.monotonic()

            while True:
                now = state(db_path)
                elapsed = time.monotonic() - sent
                settled = (
                    now["charges without a paid or refunded order"] == 0 and now["pending keys"] == 0
                )
                if settled or elapsed > args.deadline_s:
                    break
                time.sleep(0.25)
            print(f"after {elapsed:.1f} s:", json.dumps(now))
            if not settled:
                print(f"FAILED: not settled within {args.deadline_s:.0f} s")
                sys.exit(1)
            print("ok: every charge belongs to a paid order or was refunded; no key is pending")
        finally:
            shop.terminate()
            shop.wait(timeout=30)


if __name__ == "__main__":
    main()
