#!/usr/bin/env bash
# The `pg-failover` topology: two PostgreSQL clusters of our own, `failover_a` (port 5441) and
# `failover_b` (port 5442), one the primary and the other a streaming standby made with
# `pg_basebackup -R`, and PgBouncer (session pooling) on 127.0.0.1:5440 pointing at the primary.
# The shops connect to 5440 only; a failover re-points PgBouncer at the promoted standby.
# No systemd: clusters run through `pg_ctlcluster --skip-systemctl-redirect`, PgBouncer as user
# postgres with its files in /var/lib/idem-topology/pg-failover/.
#
#   up                   install what is missing, start a primary, a standby and PgBouncer
#   reset sync|async     keep the running primary, drop and recreate its database `shop`,
#                        rebuild the other cluster as its standby (pg_basebackup -R), and set
#                        synchronous_standby_names ('*' or ''); PgBouncer points at the primary
#   pause-replication    SIGSTOP the primary's WAL sender (the standby stops receiving)
#   kill-primary         SIGKILL the primary's postmaster and every process it started
#   promote              promote the standby (pg_ctl promote), clear its
#                        synchronous_standby_names, re-point PgBouncer and RELOAD
#   status               the role of each cluster
#   down                 stop everything and remove the clusters and PgBouncer's files
#
# `faults --topology pg-failover` runs reset, pause-replication, kill-primary and promote.
set -euo pipefail

version="${PG_VERSION:-15}"
clusters=(failover_a failover_b)
declare -A port=([failover_a]=5441 [failover_b]=5442)
proxy_port=5440
dir=/var/lib/idem-topology/pg-failover
socket_dir=/var/run/postgresql

say() { echo "pg-failover: $*" >&2; }
die() { say "$*"; exit 1; }
as_pg() { runuser -u postgres -- "$@"; }
# psql as the superuser over the Unix socket of cluster $1.
q() { as_pg psql -XtAq -v ON_ERROR_STOP=1 -h "$socket_dir" -p "${port[$1]}" -d postgres -c "$2"; }
exists() { [ -d "/etc/postgresql/$version/$1" ]; }
ready() { pg_isready -q -h 127.0.0.1 -p "${port[$1]}" 2>/dev/null; }
data_dir() { echo "/var/lib/postgresql/$version/$1"; }
wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2
  shift 2
  for _ in $(seq 1 $((limit * 4))); do "$@" && return 0; sleep 0.25; done
  die "timed out after ${limit}s waiting for $what"
}
in_recovery() { [ "$(q "$1" "SELECT pg_is_in_recovery()")" = t ]; }
is_primary() { ready "$1" && [ "$(q "$1" "SELECT pg_is_in_recovery()" 2>/dev/null)" = f ]; }
other() { [ "$1" = failover_a ] && echo failover_b || echo failover_a; }
primary() {
  local c
  for c in "${clusters[@]}"; do
    if exists "$c" && is_primary "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

install() {
  local need=()
  ls /usr/lib/postgresql/"$version"/bin/postgres >/dev/null 2>&1 || need+=("postgresql-$version")
  command -v pgbouncer >/dev/null 2>&1 || need+=(pgbouncer)
  if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
  # The Debian package starts nothing without systemd; its `main` cluster is not ours to touch.
}

# Writes this cluster's settings (conf.d is included by Debian's postgresql.conf).
configure() {
  local c=$1 conf="/etc/postgresql/$version/$1"
  cat >"$conf/conf.d/50-failover.conf" <<EOF
listen_addresses = '127.0.0.1'
wal_level = replica
max_wal_senders = 4
hot_standby = on
max_connections = 200
# A commit is acknowledged once flushed here and (when synchronous_standby_names names a standby)
# on the standby: the library's completions and recovery points rely on it.
synchronous_commit = on
EOF
  sync_names "$c" ""
  # The replication user reaches the primary over 127.0.0.1; the shops' user likewise.
  if ! grep -q "^host replication replicator 127.0.0.1/32" "$conf/pg_hba.conf"; then
    sed -i '1i host replication replicator 127.0.0.1/32 scram-sha-256' "$conf/pg_hba.conf"
  fi
  echo manual >"$conf/start.conf"
}

# sync_names CLUSTER VALUE: synchronous_standby_names of CLUSTER (its own file, never copied to
# the standby: a promoted standby must not wait for a standby it does not have).
sync_names() {
  echo "synchronous_standby_names = '$2'" >"/etc/postgresql/$version/$1/conf.d/60-sync.conf"
}

start_cluster() {
  local c=$1
  if ! ready "$c"; then
    pg_ctlcluster --skip-systemctl-redirect "$version" "$c" start
  fi
  wait_for 60 "$c to accept connections" ready "$c"
}

# Removes a cluster entirely (whatever state its processes are in).
destroy() {
  local c=$1
  exists "$c" || return 0
  pg_ctlcluster --skip-systemctl-redirect "$version" "$c" stop -m immediate >/dev/null 2>&1 || true
  pg_dropcluster "$version" "$c" >/dev/null 2>&1 || true
  rm -rf "/etc/postgresql/$version/$c" "$(data_dir "$c")" \
    "/var/log/postgresql/postgresql-$version-$c.log"
}

new_primary() {
  local c=$1
  destroy "$c"
  pg_createcluster "$version" "$c" -p "${port[$c]}" >/dev/null
  configure "$c"
  start_cluster "$c"
  q "$c" "CREATE ROLE replicator WITH REPLICATION LOGIN PASSWORD 'replicator'"
  q "$c" "CREATE ROLE idem WITH LOGIN CREATEDB PASSWORD 'idem'"
}

# new_standby CLUSTER PRIMARY: a fresh copy of PRIMARY that streams from it.
new_standby() {
  local c=$1 p=$2
  destroy "$c"
  pg_createcluster "$version" "$c" -p "${port[$c]}" >/dev/null
  configure "$c"
  rm -rf "$(data_dir "$c")"
  as_pg pg_basebackup -D "$(data_dir "$c")" -R -X stream -c fast \
    -d "host=127.0.0.1 port=${port[$p]} user=replicator password=replicator application_name=$c"
  start_cluster "$c"
  in_recovery "$c" || die "$c is not a standby"
  wait_for 60 "$c to stream from $p" streaming "$p" "$c"
}

streaming() { [ "$(q "$1" "SELECT count(*) FROM pg_stat_replication WHERE application_name = '$2' AND state = 'streaming'")" = 1 ]; }
synchronous() { [ "$(q "$1" "SELECT count(*) FROM pg_stat_replication WHERE application_name = '$2' AND sync_state = 'sync'")" = 1 ]; }

pgbouncer_pid() { cat "$dir/pgbouncer.pid" 2>/dev/null; }
pgbouncer_up() { local pid; pid=$(pgbouncer_pid) && kill -0 "$pid" 2>/dev/null; }

# point CLUSTER: PgBouncer's database `shop` on CLUSTER's port; started, or RELOADed when running.
point() {
  local c=$1
  mkdir -p "$dir"
  cat >"$dir/pgbouncer.ini.new" <<EOF
;; Written by .ci/topology/pg-failover.sh: the shops' endpoint, re-pointed at each failover.
[databases]
shop = host=127.0.0.1 port=${port[$c]} dbname=shop

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $proxy_port
unix_socket_dir =
auth_type = scram-sha-256
auth_file = $dir/userlist.txt
admin_users = idem
pool_mode = session
max_client_conn = 400
default_pool_size = 100
; sqlx sends it at start-up; PgBouncer does not track it.
ignore_startup_parameters = extra_float_digits
; Fail fast while no primary answers: the shops answer 503 and their clients retry.
server_connect_timeout = 2
server_login_retry = 1
query_wait_timeout = 10
pidfile = $dir/pgbouncer.pid
logfile = $dir/pgbouncer.log
EOF
  echo '"idem" "idem"' >"$dir/userlist.txt"
  mv "$dir/pgbouncer.ini.new" "$dir/pgbouncer.ini"
  chown -R postgres:postgres "$dir"
  if pgbouncer_up; then
    PGPASSWORD=idem psql -XtAq -h 127.0.0.1 -p "$proxy_port" -U idem -d pgbouncer -c RELOAD >/dev/null
  else
    as_pg pgbouncer -d -q "$dir/pgbouncer.ini"
    wait_for 30 "PgBouncer on $proxy_port" pg_isready -q -h 127.0.0.1 -p "$proxy_port" -d shop -U idem
  fi
  say "PgBouncer on $proxy_port points at $c (${port[$c]})"
}

up() {
  install
  local p
  if p=$(primary); then
    say "primary $p already running"
  else
    new_primary failover_a
    p=failover_a
  fi
  if [ "$(q "$p" "SELECT count(*) FROM pg_database WHERE datname = 'shop'")" = 0 ]; then
    q "$p" "CREATE DATABASE shop OWNER idem"
  fi
  local s
  s=$(other "$p")
  if ! { exists "$s" && ready "$s" && streaming "$p" "$s"; }; then
    new_standby "$s" "$p"
  fi
  point "$p"
  say "up: primary $p (${port[$p]}), standby $s (${port[$s]}), PgBouncer on $proxy_port"
}

reset() {
  local mode=${1:-} p s
  case "$mode" in sync | async) ;; *) die "reset sync|async" ;; esac
  p=$(primary) || die "no primary is running (run: $0 up)"
  s=$(other "$p")
  # Asynchronous while the standby is rebuilt: a synchronous primary without its standby waits.
  sync_names "$p" ""
  q "$p" "SELECT pg_reload_conf()" >/dev/null
  q "$p" "DROP DATABASE IF EXISTS shop WITH (FORCE)"
  q "$p" "CREATE DATABASE shop OWNER idem"
  new_standby "$s" "$p"
  if [ "$mode" = sync ]; then
    sync_names "$p" "*"
    q "$p" "SELECT pg_reload_conf()" >/dev/null
    wait_for 60 "$s to be the synchronous standby" synchronous "$p" "$s"
  fi
  point "$p"
  say "reset ($mode): primary $p (${port[$p]}), standby $s (${port[$s]}) $(q "$p" "SELECT sync_state FROM pg_stat_replication")"
}

pause_replication() {
  local p pids
  p=$(primary) || die "no primary is running"
  pids=$(q "$p" "SELECT pid FROM pg_stat_replication")
  [ -n "$pids" ] || die "$p has no WAL sender"
  # shellcheck disable=SC2086 # one pid per word
  kill -STOP $pids
  say "WAL sender of $p stopped (pid $pids)"
}

kill_primary() {
  local p pid children
  p=$(primary) || die "no primary is running"
  pid=$(head -n 1 "$(data_dir "$p")/postmaster.pid")
  # Stop the postmaster first so that it forks nothing more, then SIGKILL it and its children
  # at once: the machine is gone (and fenced: no orphaned backend goes on serving).
  kill -STOP "$pid"
  children=$(pgrep -P "$pid" || true)
  # shellcheck disable=SC2086 # one pid per word
  kill -KILL "$pid" $children
  for c in $pid $children; do
    wait_for 30 "process $c to die" bash -c "! kill -0 $c 2>/dev/null"
  done
  say "SIGKILLed the postmaster of $p (pid $pid) and its $(echo "$children" | wc -w) children"
  echo "$p"
}

promote() {
  local s
  s=""
  for c in "${clusters[@]}"; do
    if exists "$c" && ready "$c" && in_recovery "$c"; then s=$c; fi
  done
  [ -n "$s" ] || die "no standby is running"
  pg_ctlcluster --skip-systemctl-redirect "$version" "$s" promote
  wait_for 60 "$s to leave recovery" is_primary "$s"
  # Alone now: with a standby named here, every commit would wait for one.
  sync_names "$s" ""
  q "$s" "SELECT pg_reload_conf()" >/dev/null
  point "$s"
  say "promoted $s (${port[$s]})"
  echo "$s"
}

status() {
  for c in "${clusters[@]}"; do
    if ! exists "$c"; then
      echo "$c: absent"
    elif ! ready "$c"; then
      echo "$c (${port[$c]}): down"
    elif in_recovery "$c"; then
      echo "$c (${port[$c]}): standby"
    else
      echo "$c (${port[$c]}): primary, replication: $(q "$c" "SELECT string_agg(application_name || ' ' || state || ' ' || sync_state, ', ') FROM pg_stat_replication")"
    fi
  done
  if pgbouncer_up; then echo "pgbouncer ($proxy_port): $(grep '^shop =' "$dir/pgbouncer.ini")"; else echo "pgbouncer: down"; fi
}

down() {
  local pid
  if pid=$(pgbouncer_pid) && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    wait_for 30 "PgBouncer to stop" bash -c "! kill -0 $pid 2>/dev/null"
  fi
  rm -rf "$dir"
  for c in "${clusters[@]}"; do
    # A killed cluster may have left a stopped process behind (a paused WAL sender is killed
    # with it, but be sure).
    destroy "$c"
  done
  # The providers' databases the scenario made on the shared server.
  if pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    local db
    for db in $(as_pg psql -XtAq -h "$socket_dir" -p 5432 -d postgres -c \
      "SELECT datname FROM pg_database WHERE datname LIKE 'topo\_pgf\_%'"); do
      as_pg psql -XtAq -h "$socket_dir" -p 5432 -d postgres -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)"
    done
  fi
  say "down"
}

case "${1:-}" in
  up) up ;;
  reset) reset "${2:-}" ;;
  pause-replication) pause_replication ;;
  kill-primary) kill_primary ;;
  promote) promote ;;
  status) status ;;
  down) down ;;
  *) die "usage: $0 up|reset sync|async|pause-replication|kill-primary|promote|status|down" ;;
esac
