#!/usr/bin/env bash
# Starts, stops or crashes the MariaDB server CI runs without systemd:
# `bash .ci/mariadb-ctl.sh start|stop|crash`. `start` returns once the server answers; `stop` once
# it has shut down; `crash` SIGKILLs it and returns once it is gone (InnoDB recovers on start).
# The fault proof (`faults --backend mysql`, scenarios db-restart and db-crash) goes through it.
set -euo pipefail
socket=/run/mysqld/mysqld.sock
ping() { mariadb-admin --socket="$socket" ping >/dev/null 2>&1; }

case "${1:-}" in
  start)
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    if ! ping; then
      (mariadbd --user=mysql --datadir=/var/lib/mysql --socket="$socket" \
         --bind-address=127.0.0.1 --port=3306 --max-connections=500 \
         --innodb-lock-wait-timeout=20 >>/tmp/mariadbd.log 2>&1 &)
      for _ in $(seq 1 240); do ping && break; sleep 0.25; done
    fi
    ping || { echo "mariadb-ctl: MariaDB did not start; see /tmp/mariadbd.log" >&2; exit 1; }
    ;;
  stop)
    if ping; then
      mariadb-admin --socket="$socket" shutdown
    fi
    for _ in $(seq 1 240); do ping || break; sleep 0.25; done
    # The port too: a restart must not race the old server's listener.
    for _ in $(seq 1 240); do pgrep -x mariadbd >/dev/null || break; sleep 0.25; done
    if ping || pgrep -x mariadbd >/dev/null; then
      echo "mariadb-ctl: MariaDB did not stop" >&2
      exit 1
    fi
    ;;
  crash)
    pkill -KILL -x mariadbd || true
    for _ in $(seq 1 240); do pgrep -x mariadbd >/dev/null || break; sleep 0.25; done
    if pgrep -x mariadbd >/dev/null; then
      echo "mariadb-ctl: MariaDB did not die" >&2
      exit 1
    fi
    ;;
  *)
    echo "usage: $0 start|stop|crash" >&2
    exit 2
    ;;
esac
