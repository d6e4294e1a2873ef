#!/usr/bin/env bash
# The `rabbitmq-cluster` topology: three RabbitMQ nodes (Debian's `rabbitmq-server`, no systemd)
# clustered with `rabbitmqctl join_cluster`, for `faults --topology rabbitmq-cluster`.
#
#   up            install if missing, start idemc1..3@localhost (AMQP 127.0.0.1:5681..5683,
#                 distribution 25681..25683, the shared epmd), cluster them, create the vhost and
#                 user idem/idem; safe to run again
#   down          SIGKILL the three nodes and remove /var/lib/idem-rabbitmq-cluster
#   kill N        SIGKILL node N's Erlang VM (beam.smp)
#   start N       start node N again (it rejoins the cluster from its data directory)
#   wait N        wait until node N runs and sees the three nodes running
#   leader QUEUE  the number of the node leading the quorum queue QUEUE (vhost idem)
#   clients       the numbers of the nodes holding client connections (vhost idem), one a line
#   members QUEUE the number of online members of the quorum queue QUEUE
#
# Everything is bound to 127.0.0.1 and lives under /var/lib/idem-rabbitmq-cluster/ (owned by the
# `rabbitmq` user, whose Erlang cookie the nodes share with the CLI). The shared broker
# rabbit@localhost (5672) is left alone.
set -euo pipefail

base=/var/lib/idem-rabbitmq-cluster
nodes=(1 2 3)

install() {
  command -v rabbitmq-server >/dev/null 2>&1 && return
  echo "rabbitmq-cluster: installing rabbitmq-server"
  # The package's postinst would start the service: forbid service starts while installing.
  local policy_added=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    policy_added=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends rabbitmq-server >/dev/null
  if [ -n "$policy_added" ]; then rm -f /usr/sbin/policy-rc.d; fi
}

name() { echo "idemc$1@localhost"; }

# The environment of node N (server and CLI alike).
node_env() {
  local dir="$base/n$1"
  echo RABBITMQ_NODENAME="$(name "$1")" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT="568$1" \
    RABBITMQ_DIST_PORT="2568$1" \
    ERL_EPMD_ADDRESS=127.0.0.1 \
    RABBITMQ_MNESIA_BASE="$dir/mnesia" \
    RABBITMQ_LOG_BASE="$dir/log" \
    RABBITMQ_CONFIG_FILE="$base/rabbitmq.conf" \
    RABBITMQ_ADVANCED_CONFIG_FILE="$base/advanced.config" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$base/enabled_plugins"
}

ctl() {
  local n="$1"
  shift
  # shellcheck disable=SC2046 # node_env prints NAME=VALUE words without spaces
  env $(node_env "$n") "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}" \
    rabbitmqctl -q "$@"
}

# The pid of node N's Erlang VM: the beam.smp whose environment names the node (the server writes
# no pid file when started in the foreground).
pid_of() {
  local pid
  for pid in $(pgrep -x beam.smp); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "RABBITMQ_NODENAME=$(name "$1")"; then
      echo "$pid"
      return 0
    fi
  done
  return 1
}

start() {
  local n="$1" dir="$base/n$1"
  if pid_of "$n" >/dev/null; then return; fi
  mkdir -p "$dir/mnesia" "$dir/log"
  chown -R rabbitmq:rabbitmq "$dir"
  # shellcheck disable=SC2046
  (env $(node_env "$n") "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}" \
    rabbitmq-server >>"$dir/server.log" 2>&1 &)
}

# Waits until node N has started (generous: three Erlang nodes start slowly on two cores).
await() {
  local n="$1"
  for _ in $(seq 1 90); do
    ctl "$n" await_startup --timeout 5 >/dev/null 2>&1 && return 0
    sleep 1
  done
  echo "rabbitmq-cluster: node $n did not start; $base/n$n/server.log and $base/n$n/log/ say why" >&2
  tail -n 30 "$base/n$n/server.log" >&2 || true
  return 1
}

# The running nodes node N sees, sorted, one a line.
running_nodes() {
  ctl "$1" cluster_status --formatter json 2>/dev/null |
    python3 -c 'import json,sys; print("\n".join(sorted(json.load(sys.stdin)["running_nodes"])))'
}

# Waits until node N sees all three nodes running.
await_cluster() {
  local n="$1" want
  want="$(printf '%s\n' "$(name 1)" "$(name 2)" "$(name 3)")"
  for _ in $(seq 1 120); do
    [ "$(running_nodes "$n" || true)" = "$want" ] && return 0
    sleep 1
  done
  echo "rabbitmq-cluster: node $n does not see the three nodes running: $(running_nodes "$n" | tr '\n' ' ')" >&2
  return 1
}

up() {
  install
  mkdir -p "$base"
  cat >"$base/rabbitmq.conf" <<'EOF'
# The topology's nodes: loopback only (listeners come from RABBITMQ_NODE_IP_ADDRESS/PORT).
loopback_users = none
EOF
  echo '[].' >"$base/advanced.config"
  echo '[].' >"$base/enabled_plugins"
  chown rabbitmq:rabbitmq "$base" "$base/rabbitmq.conf" "$base/advanced.config" "$base/enabled_plugins"
  for n in "${nodes[@]}"; do start "$n"; done
  for n in "${nodes[@]}"; do await "$n"; done
  for n in 2 3; do
    if ! running_nodes "$n" | grep -x "$(name 1)" >/dev/null; then
      local log="$base/n$n/join.log"
      if ! { ctl "$n" stop_app && ctl "$n" reset && ctl "$n" join_cluster "$(name 1)" &&
        ctl "$n" start_app; } >"$log" 2>&1; then
        echo "rabbitmq-cluster: node $n could not join node 1:" >&2
        cat "$log" >&2
        return 1
      fi
    fi
  done
  await_cluster 1
  ctl 1 list_users | awk '{print $1}' | grep -qx idem || ctl 1 add_user idem idem >/dev/null
  ctl 1 list_vhosts | grep -qx idem || ctl 1 add_vhost idem >/dev/null
  ctl 1 set_permissions -p idem idem '.*' '.*' '.*' >/dev/null
  echo "rabbitmq-cluster: $(name 1), $(name 2), $(name 3) clustered;" \
    "AMQP amqp://idem:idem@127.0.0.1:5681/idem (and :5682, :5683)"
}

down() {
  for n in "${nodes[@]}"; do
    local pid
    if pid="$(pid_of "$n")"; then
      kill -9 "$pid"
      while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
    fi
  done
  rm -rf "$base"
  echo "rabbitmq-cluster: down"
}

kill_node() {
  local n="$1" pid
  pid="$(pid_of "$n")" || {
    echo "rabbitmq-cluster: node $n is not running" >&2
    return 1
  }
  kill -9 "$pid"
  while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  echo "rabbitmq-cluster: node $n (pid $pid) SIGKILLed"
}

# The first node of the three that answers.
any_node() {
  for n in "${nodes[@]}"; do
    if pid_of "$n" >/dev/null && ctl "$n" ping >/dev/null 2>&1; then
      echo "$n"
      return 0
    fi
  done
  return 1
}

leader() {
  ctl "$(any_node || echo 1)" list_queues -p idem name leader --formatter json |
    python3 -c 'import json,sys
q = [r for r in json.load(sys.stdin) if r["name"] == sys.argv[1]]
print(q[0]["leader"].split("@")[0].removeprefix("idemc") if q and q[0].get("leader") else "")' "$1"
}

members() {
  ctl "$(any_node || echo 1)" list_queues -p idem name online --formatter json |
    python3 -c 'import json,sys
q = [r for r in json.load(sys.stdin) if r["name"] == sys.argv[1]]
print(len(q[0]["online"]) if q and isinstance(q[0].get("online"), list) else 0)' "$1"
}

clients() {
  ctl "$(any_node || echo 1)" list_connections -p idem port --formatter json |
    python3 -c 'import json,sys
for r in json.load(sys.stdin): print(r["port"] - 5680)'
}

case "${1:-}" in
up) up ;;
down) down ;;
kill) kill_node "${2:?node number}" ;;
start) start "${2:?node number}" && await "$2" ;;
wait) await "${2:?node number}" && await_cluster "$2" ;;
leader) leader "${2:?queue}" ;;
members) members "${2:?queue}" ;;
clients) clients ;;
*)
  echo "usage: $0 up|down|kill N|start N|wait N|leader QUEUE|members QUEUE|clients" >&2
  exit 2
  ;;
esac
