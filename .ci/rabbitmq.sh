#!/usr/bin/env bash
# Installs (if missing) and starts RabbitMQ (Debian's `rabbitmq-server`) without systemd, listening
# on 127.0.0.1 only (AMQP, epmd and the Erlang distribution alike), creates the user `idem` and the
# vhost `idem`, and exports TEST_AMQP_URL. Source it: `. .ci/rabbitmq.sh`.
# Safe to run again: a broker already up is left as it is.
set -euo pipefail

if ! command -v rabbitmq-server >/dev/null 2>&1; then
  echo "ci: installing rabbitmq-server"
  # The package's postinst would start the service through invoke-rc.d (on all interfaces):
  # forbid service starts while installing, unless the machine forbids them already.
  policy_added=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    policy_added=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends rabbitmq-server >/dev/null
  if [ -n "$policy_added" ]; then rm -f /usr/sbin/policy-rc.d; fi
fi

# Everything the node opens is bound to the loopback interface: AMQP (5672), epmd (4369) and the
# Erlang distribution (25672, used by rabbitmqctl). The node is named after `localhost`, so a
# container's hostname need not resolve.
rabbit_env=(
  RABBITMQ_NODENAME=rabbit@localhost
  RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
  RABBITMQ_NODE_PORT=5672
  RABBITMQ_DIST_PORT=25672
  ERL_EPMD_ADDRESS=127.0.0.1
  "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}"
)
rabbitmqctl_() { env "${rabbit_env[@]}" rabbitmqctl -q "$@"; }

if ! rabbitmqctl_ ping >/dev/null 2>&1; then
  (env "${rabbit_env[@]}" rabbitmq-server >/tmp/rabbitmq-server.log 2>&1 &)
  for _ in $(seq 1 60); do
    rabbitmqctl_ await_startup --timeout 5 >/dev/null 2>&1 && break
    sleep 1
  done
fi
if ! rabbitmqctl_ await_startup --timeout 10; then
  echo "ci: RabbitMQ did not start; /tmp/rabbitmq-server.log and /var/log/rabbitmq/ say why" >&2
  tail -n 30 /tmp/rabbitmq-server.log >&2 || true
  exit 1
fi

rabbitmqctl_ list_users | awk '{print $1}' | grep -qx idem || rabbitmqctl_ add_user idem idem >/dev/null
rabbitmqctl_ list_vhosts | grep -qx idem || rabbitmqctl_ add_vhost idem >/dev/null
rabbitmqctl_ set_permissions -p idem idem '.*' '.*' '.*' >/dev/null

export TEST_AMQP_URL="amqp://idem:idem@127.0.0.1:5672/idem"
export RABBITMQ_VERSION="$(rabbitmqctl_ version 2>/dev/null || echo unknown)"
echo "ci: RabbitMQ $RABBITMQ_VERSION at $TEST_AMQP_URL"
