#!/usr/bin/env bash
# Installs (if missing) and starts PostgreSQL and MariaDB without systemd, creates a test user on
# 127.0.0.1, and exports TEST_POSTGRES_URL and TEST_MYSQL_URL. Source it: `. .ci/databases.sh`.
# Safe to run again: a server already up is left as it is.
set -euo pipefail

need=()
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || need+=(postgresql)
command -v mariadbd >/dev/null 2>&1 || need+=(mariadb-server)
if [ ${#need[@]} -gt 0 ]; then
  echo "ci: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# --- PostgreSQL -------------------------------------------------------------------------------
pg_version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$pg_version main"; then
  pg_createcluster "$pg_version" main >/dev/null
fi
if ! pg_lsclusters -h | awk '$1=="'"$pg_version"'" && $2=="main" {print $4}' | grep -qx online; then
  pg_ctlcluster --skip-systemctl-redirect "$pg_version" main start
fi
for _ in $(seq 1 60); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
pg_isready -h 127.0.0.1 -p 5432
su postgres -c "psql -q -v ON_ERROR_STOP=1" <<'SQL'
SELECT 'CREATE ROLE idem LOGIN SUPERUSER PASSWORD ''idem'''
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'idem') \gexec
SELECT 'CREATE DATABASE idem OWNER idem'
WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'idem') \gexec
ALTER SYSTEM SET max_connections = 300;
ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements';
SQL
# Both settings need a restart to take effect; do it once. pg_stat_statements lets the
# benchmarks count the statements a request runs.
if [ "$(su postgres -c "psql -tAc 'SHOW max_connections'")" != 300 ] ||
   [ "$(su postgres -c "psql -tAc 'SHOW shared_preload_libraries'")" != pg_stat_statements ]; then
  pg_ctlcluster --skip-systemctl-redirect "$pg_version" main restart
  for _ in $(seq 1 60); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
fi
export TEST_POSTGRES_URL="postgres://idem:idem@127.0.0.1:5432/idem"
export PG_VERSION="$pg_version"

# --- MariaDB ----------------------------------------------------------------------------------
mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
if [ ! -d /var/lib/mysql/mysql ]; then
  mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
fi
# Started (and, by the fault proof, restarted) through one script: one command line.
bash "$(dirname "${BASH_SOURCE[0]}")/mariadb-ctl.sh" start
mariadb-admin --socket=/run/mysqld/mysqld.sock ping
mariadb --socket=/run/mysqld/mysqld.sock <<'SQL'
CREATE USER IF NOT EXISTS 'idem'@'127.0.0.1' IDENTIFIED BY 'idem';
CREATE USER IF NOT EXISTS 'idem'@'localhost' IDENTIFIED BY 'idem';
GRANT ALL PRIVILEGES ON *.* TO 'idem'@'127.0.0.1' WITH GRANT OPTION;
GRANT ALL PRIVILEGES ON *.* TO 'idem'@'localhost' WITH GRANT OPTION;
CREATE DATABASE IF NOT EXISTS idem;
FLUSH PRIVILEGES;
SQL
export TEST_MYSQL_URL="mysql://idem:idem@127.0.0.1:3306/idem"
export MARIADB_VERSION="$(mariadb --version)"
echo "ci: PostgreSQL $pg_version at $TEST_POSTGRES_URL; MariaDB at $TEST_MYSQL_URL"
