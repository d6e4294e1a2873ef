#!/usr/bin/env bash
# A three-node MariaDB Galera cluster on one machine, for `faults --topology galera`, without
# systemd: `bash .ci/topology/galera.sh up|down|start N|kill N|status`.
#
#   node N (1..3): mariadbd as user mysql, SQL on 127.0.0.1:331N, socket /run/idem-galera/nN.sock,
#   datadir /var/lib/idem-galera/nN (its options in /var/lib/idem-galera/nN.cnf, its log in
#   /var/lib/idem-galera/nN.err); Galera replication on 457N, incremental state transfer (IST) on
#   458N, rsync state snapshot transfer (SST) received on 459N (the joiner's rsync daemon listens
#   there on every join, even when the donor sends IST: it cannot share the IST port).
#
# up       installs what is missing, starts the nodes that are not running (node 1 bootstraps a
#          new cluster when none is running: a stopped cluster's data is thrown away), waits until
#          every node is Synced, and creates the user idem/idem and the database idem. Safe to run
#          again.
# start N  starts node N again after a crash: recovers its position from InnoDB
#          (`--wsrep-recover`), joins the running cluster (IST from a donor) and returns once it
#          is Synced.
# kill N   SIGKILLs node N's mariadbd and returns once it is gone (the fault proof does the same
#          by itself).
# down     stops every node and removes /var/lib/idem-galera and /run/idem-galera.
# The shared MariaDB on 3306 is never touched: every node reads only its own --defaults-file.
set -euo pipefail
base=/var/lib/idem-galera
run=/run/idem-galera
nodes=(1 2 3)
cluster="gcomm://127.0.0.1:4571,127.0.0.1:4572,127.0.0.1:4573"

log() { printf 'galera: %s\n' "$*" >&2; }
sql() { local n=$1; shift; mariadb --no-defaults --socket="$run/n$n.sock" -uroot "$@"; }
ping() { mariadb-admin --no-defaults --socket="$run/n$1.sock" -uroot ping >/dev/null 2>&1; }
pid_of() { cat "$run/n$1.pid" 2>/dev/null || true; }
alive() { local pid; pid=$(pid_of "$1"); [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }
state() { sql "$1" -N -e "SHOW STATUS LIKE 'wsrep_local_state_comment'" 2>/dev/null | cut -f2; }

install() {
  local need=()
  command -v mariadbd >/dev/null 2>&1 || need+=(mariadb-server)
  [ -e /usr/lib/galera/libgalera_smm.so ] || need+=(galera-4)
  command -v rsync >/dev/null 2>&1 || need+=(rsync)
  # The rsync SST script checks its listener with ss (iproute2).
  command -v ss >/dev/null 2>&1 || need+=(iproute2)
  if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
}

config() {
  local n=$1
  cat >"$base/n$n.cnf" <<EOF
[mysqld]
user = mysql
datadir = $base/n$n
socket = $run/n$n.sock
pid-file = $run/n$n.pid
log-error = $base/n$n.err
bind-address = 127.0.0.1
port = 331$n
max-connections = 300
skip-name-resolve
# Galera's requirements: row-based replication, InnoDB, interleaved auto-increment locks.
binlog-format = ROW
default-storage-engine = InnoDB
innodb-autoinc-lock-mode = 2
innodb-buffer-pool-size = 64M
innodb-log-file-size = 32M
innodb-lock-wait-timeout = 20
wsrep-on = ON
wsrep-provider = /usr/lib/galera/libgalera_smm.so
wsrep-cluster-name = idem-galera
wsrep-cluster-address = $cluster
wsrep-node-name = n$n
wsrep-node-address = 127.0.0.1:457$n
wsrep-node-incoming-address = 127.0.0.1:331$n
wsrep-provider-options = "gmcast.listen_addr=tcp://127.0.0.1:457$n;ist.recv_addr=127.0.0.1:458$n;gcache.size=128M"
wsrep-sst-method = rsync
wsrep-sst-receive-address = 127.0.0.1:459$n
# Causal reads: a read waits until this node has applied every write the cluster committed
# before it (docs/deployment.md, "MariaDB Galera").
wsrep-sync-wait = ${GALERA_SYNC_WAIT:-1}
EOF
}

# Waits until node N answers and is Synced.
wait_synced() {
  local n=$1
  for _ in $(seq 1 720); do
    [ "$(state "$n")" = Synced ] && return 0
    if ! alive "$n" && [ -s "$run/n$n.pid" ]; then
      sleep 0.5
      alive "$n" || { log "node $n exited; see $base/n$n.err"; tail -n 30 "$base/n$n.err" >&2; return 1; }
    fi
    sleep 0.25
  done
  log "node $n is not Synced after 180 s (state: $(state "$n")); see $base/n$n.err"
  return 1
}

launch() {
  local n=$1; shift
  rm -f "$run/n$n.pid"
  # Detached, its output in a file: the caller (the fault proof) does not wait for it.
  setsid mariadbd --defaults-file="$base/n$n.cnf" "$@" </dev/null >>"$base/n$n.out" 2>&1 &
  # The pid file appears once the server is up; until then, wait_synced polls the socket.
}

# The position node N's InnoDB holds (after a crash the grastate file does not have it).
recovered_position() {
  local n=$1 log="$base/n$n.recover.log"
  rm -f "$log"
  mariadbd --defaults-file="$base/n$n.cnf" --wsrep-recover --log-error="$log" >/dev/null 2>&1 || true
  sed -n 's/.*WSREP: Recovered position: *\([^ ]*\).*/\1/p' "$log" | tail -n 1
}

start_node() {
  local n=$1 position
  if ping "$n"; then
    wait_synced "$n"
    return
  fi
  mkdir -p "$base/n$n" "$run"
  chown mysql:mysql "$base" "$base/n$n" "$run"
  config "$n"
  position=""
  if [ -e "$base/n$n/ibdata1" ]; then
    position=$(recovered_position "$n")
  fi
  log "starting node $n${position:+ at $position}"
  if [ -n "$position" ]; then
    launch "$n" --wsrep-start-position="$position"
  else
    launch "$n"
  fi
  wait_synced "$n"
}

bootstrap() {
  log "bootstrapping a new cluster on node 1"
  rm -rf "$base" "$run"
  mkdir -p "$base/n1" "$run"
  chown mysql:mysql "$base" "$base/n1" "$run"
  config 1
  mariadb-install-db --no-defaults --user=mysql --datadir="$base/n1" --skip-test-db \
    >"$base/n1.install.log" 2>&1 || { cat "$base/n1.install.log" >&2; exit 1; }
  launch 1 --wsrep-new-cluster
  wait_synced 1
}

up() {
  install
  local running=0
  for n in "${nodes[@]}"; do ping "$n" && running=1; done
  [ $running = 1 ] || bootstrap
  # One joiner at a time: each SST takes a donor.
  for n in "${nodes[@]}"; do start_node "$n"; done
  sql 1 <<'SQL'
CREATE USER IF NOT EXISTS 'idem'@'127.0.0.1' IDENTIFIED BY 'idem';
CREATE USER IF NOT EXISTS 'idem'@'localhost' IDENTIFIED BY 'idem';
GRANT ALL PRIVILEGES ON *.* TO 'idem'@'127.0.0.1' WITH GRANT OPTION;
GRANT ALL PRIVILEGES ON *.* TO 'idem'@'localhost' WITH GRANT OPTION;
CREATE DATABASE IF NOT EXISTS idem;
SQL
  status
}

kill_node() {
  local n=$1 pid
  pid=$(pid_of "$n")
  [ -n "$pid" ] || { log "node $n has no pid file"; return 1; }
  kill -KILL "$pid" 2>/dev/null || true
  for _ in $(seq 1 240); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
  log "node $n (pid $pid) did not die"
  return 1
}

down() {
  local pid
  for n in "${nodes[@]}"; do
    if ping "$n"; then
      mariadb-admin --no-defaults --socket="$run/n$n.sock" -uroot shutdown || true
    fi
  done
  for n in "${nodes[@]}"; do
    pid=$(pid_of "$n")
    for _ in $(seq 1 120); do { [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; } || break; sleep 0.25; done
    [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null || true
  done
  # Anything else started from these nodes' files: a server still joining (no pid file yet), an
  # SST script's rsync daemon.
  for pid in $(pgrep -f -- "--defaults-file=$base/" || true) \
             $(cat "$base"/n*/rsync_sst.pid 2>/dev/null || true); do
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$base" "$run"
  log "down"
}

status() {
  for n in "${nodes[@]}"; do
    if ping "$n"; then
      printf 'galera: node %s (port 331%s, pid %s): %s, cluster size %s\n' "$n" "$n" "$(pid_of "$n")" \
        "$(state "$n")" "$(sql "$n" -N -e "SHOW STATUS LIKE 'wsrep_cluster_size'" | cut -f2)"
    else
      printf 'galera: node %s: down\n' "$n"
    fi
  done
}

node_arg() {
  case "${1:-}" in
    1|2|3) ;;
    *) echo "usage: $0 start|kill 1|2|3" >&2; exit 2 ;;
  esac
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  start) node_arg "${2:-}"; install; start_node "$2" ;;
  kill) node_arg "${2:-}"; kill_node "$2" ;;
  status) status ;;
  *) echo "usage: $0 up|down|start N|kill N|status" >&2; exit 2 ;;
esac
