#!/usr/bin/env bash
# The `pgbouncer` topology: PgBouncer on 127.0.0.1:6432 in transaction pooling mode, in front of
# the PostgreSQL server on 127.0.0.1:5432 (started by .ci/databases.sh; user idem, password idem).
# Every database of that server is reachable through it under its own name; the scenario creates
# its databases (names starting topo_pgb_) on 5432 directly.
#
#   bash .ci/topology/pgbouncer.sh up     installs pgbouncer if missing, starts it, waits for it
#   bash .ci/topology/pgbouncer.sh down   stops it, removes its folder and the topo_pgb_ databases
#
# Run as root (CI: a fresh Debian machine, no systemd); PgBouncer itself runs as `postgres`.
# Safe to run again: `up` leaves a running PgBouncer as it is.
set -euo pipefail

dir=/var/lib/idem-topology/pgbouncer
port=6432
server="postgres://idem:idem@127.0.0.1:5432/postgres"

pid() { [ -s "$dir/pgbouncer.pid" ] && cat "$dir/pgbouncer.pid"; }
running() { local p; p="$(pid)" && kill -0 "$p" 2>/dev/null; }
answers() { PGPASSWORD=idem psql -h 127.0.0.1 -p "$port" -U idem -d pgbouncer -qAtc "SHOW VERSION" >/dev/null 2>&1; }

up() {
  if ! command -v pgbouncer >/dev/null 2>&1; then
    echo "topology: installing pgbouncer"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends pgbouncer >/dev/null
  fi
  if running && answers; then
    echo "topology: pgbouncer already up on 127.0.0.1:$port"
    return
  fi
  mkdir -p "$dir"
  # Transaction pooling. A shop's request may hold its business transaction while it takes a
  # second connection (the payment provider's pool, a lease extension), so a database's pool
  # must be larger than the transactions the shops hold open at once (two shops: 2 x (16 + 8)
  # connections), or they wait for each other until their requests time out. At most 64 server
  # connections in all (the PostgreSQL server is shared); idle ones close after 30 s. sqlx sends
  # extra_float_digits at start-up, which PgBouncer refuses unless told to ignore it.
  cat >"$dir/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir = $dir
auth_type = scram-sha-256
auth_file = $dir/userlist.txt
admin_users = idem
stats_users = idem
pool_mode = transaction
default_pool_size = 60
max_user_connections = 64
max_client_conn = 400
server_idle_timeout = 30
ignore_startup_parameters = extra_float_digits
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
INI
  printf '"idem" "idem"\n' >"$dir/userlist.txt"
  chown -R postgres:postgres "$dir"
  chmod 600 "$dir/userlist.txt"
  rm -f "$dir/pgbouncer.pid"
  su postgres -s /bin/sh -c "pgbouncer -d -q $dir/pgbouncer.ini"
  for _ in $(seq 1 120); do answers && break; sleep 0.5; done
  if ! answers; then
    echo "topology: pgbouncer did not answer on 127.0.0.1:$port; its log:" >&2
    tail -n 30 "$dir/pgbouncer.log" >&2 || true
    exit 1
  fi
  echo "topology: pgbouncer $(pgbouncer --version | head -n 1 | cut -d' ' -f2) up on 127.0.0.1:$port (transaction pooling) in front of 127.0.0.1:5432"
}

down() {
  local p
  if p="$(pid)"; then
    kill -KILL "$p" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
  fi
  rm -rf "$dir"
  rmdir /var/lib/idem-topology 2>/dev/null || true
  if pg_isready -q -h 127.0.0.1 -p 5432; then
    psql -q "$server" -Atc "SELECT datname FROM pg_database WHERE datname LIKE 'topo\_pgb\_%'" |
      while read -r db; do psql -q "$server" -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)"; done
  fi
  echo "topology: pgbouncer down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
