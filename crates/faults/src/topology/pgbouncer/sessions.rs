//! PgBouncer's admin console, and the check that nothing of a session outlived its transaction
//! on the server connections PgBouncer holds for a database.

use super::{Bouncer, Breakage, PhaseDb};
use anyhow::{bail, ensure, Context, Result};
use sqlx::{Connection, Executor, PgConnection, Row};
use std::collections::{BTreeMap, BTreeSet};

/// Runs `command` on PgBouncer's admin console (`psql`, which speaks its simple protocol);
/// returns its rows as column name → value.
pub(super) async fn admin(
    bouncer: &Bouncer,
    command: &str,
) -> Result<Vec<BTreeMap<String, String>>> {
    let out = tokio::process::Command::new("psql")
        .args(["-X", "-A", "-F", "|", "-P", "footer=off", "-c", command])
        .arg(bouncer.admin_url()?)
        .output()
        .await
        .context("running psql")?;
    ensure!(
        out.status.success(),
        "{command} on PgBouncer's admin console at {} failed (is it up? bash .ci/topology/pgbouncer.sh up): {}",
        bouncer.addr,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or_default().split('|').collect();
    Ok(lines
        .map(|line| {
            header
                .iter()
                .zip(line.split('|'))
                .map(|(name, value)| (name.to_string(), value.to_string()))
                .collect()
        })
        .collect())
}

/// Fails unless PgBouncer answers and pools in transaction mode.
pub(super) async fn ensure_transaction_pooling(bouncer: &Bouncer) -> Result<()> {
    let config = admin(bouncer, "SHOW CONFIG").await?;
    let mode = config
        .iter()
        .find(|row| row.get("key").map(String::as_str) == Some("pool_mode"))
        .and_then(|row| row.get("value").cloned())
        .unwrap_or_default();
    ensure!(
        mode == "transaction",
        "PgBouncer at {} pools in {mode:?} mode, not transaction",
        bouncer.addr
    );
    Ok(())
}

/// What one server connection showed inside a transaction.
#[derive(Debug)]
struct Seen {
    pid: i32,
    lock_timeout: String,
    statement_timeout: String,
    prepared: i64,
    listening: i64,
}

const LOOK: &str = "SELECT pg_backend_pid(), current_setting('lock_timeout'),
    current_setting('statement_timeout'),
    (SELECT count(*) FROM pg_prepared_statements), (SELECT count(*) FROM pg_listening_channels())";

/// Visits every server connection PgBouncer holds for `db` (as many transactions through it at
/// once as it has server connections, so each gets its own) and checks that each shows the
/// server's defaults (read on a fresh direct session), no prepared statement and no `LISTEN`.
/// Returns a summary of what it saw.
pub(super) async fn check(bouncer: &Bouncer, db: &PhaseDb) -> Result<String> {
    let mut direct = PgConnection::connect(&db.direct).await?;
    let defaults: (String, String) = sqlx::query_as(
        "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')",
    )
    .fetch_one(&mut direct)
    .await?;
    direct.close().await?;
    if bouncer.breakage == Some(Breakage::Leak) {
        let mut leaking = PgConnection::connect(&db.pooled).await?;
        leaking.execute("SET lock_timeout = '1234ms'").await?;
        leaking.close().await?;
    }
    let servers: BTreeSet<i32> = admin(bouncer, "SHOW SERVERS")
        .await?
        .iter()
        .filter(|row| row.get("database") == Some(&db.name))
        .filter_map(|row| row.get("remote_pid")?.parse().ok())
        .collect();
    ensure!(
        !servers.is_empty(),
        "PgBouncer holds no server connection for {}: nothing went through it",
        db.name
    );
    let seen = visit(db, servers.len()).await?;
    let pids: BTreeSet<i32> = seen.iter().map(|s| s.pid).collect();
    let missed: Vec<_> = servers.difference(&pids).collect();
    ensure!(
        missed.is_empty(),
        "server connections {missed:?} were not visited"
    );
    let bad: Vec<String> = seen
        .iter()
        .filter(|s| {
            (s.lock_timeout.as_str(), s.statement_timeout.as_str())
                != (defaults.0.as_str(), defaults.1.as_str())
                || s.prepared != 0
                || s.listening != 0
        })
        .map(|s| format!("{s:?}"))
        .collect();
    if !bad.is_empty() {
        bail!(
            "a session outlived its transaction on {} of {} server connections (defaults: lock_timeout {:?}, statement_timeout {:?}): {}",
            bad.len(),
            seen.len(),
            defaults.0,
            defaults.1,
            bad.join("; ")
        );
    }
    let pools = admin(bouncer, "SHOW POOLS").await?;
    let pool = pools
        .iter()
        .find(|row| row.get("database") == Some(&db.name))
        .context("no pool for the database in SHOW POOLS")?;
    let field = |name: &str| pool.get(name).cloned().unwrap_or_default();
    Ok(format!(
        "{} server connections visited: lock_timeout {:?}, statement_timeout {:?} (the defaults), 0 prepared statements, 0 LISTEN; SHOW POOLS: cl_active {}, cl_waiting {}, sv_active {}, sv_idle {}, sv_used {}, maxwait {}s",
        seen.len(),
        defaults.0,
        defaults.1,
        field("cl_active"),
        field("cl_waiting"),
        field("sv_active"),
        field("sv_idle"),
        field("sv_used"),
        field("maxwait"),
    ))
}

/// Opens `n` transactions through PgBouncer at once (each holds a server connection of its own)
/// and looks at each server connection; simple-protocol statements only.
async fn visit(db: &PhaseDb, n: usize) -> Result<Vec<Seen>> {
    let mut conns = Vec::new();
    let mut seen = Vec::new();
    for _ in 0..n {
        let mut conn = PgConnection::connect(&db.pooled).await?;
        conn.execute("BEGIN").await?;
        let row = conn.fetch_one(LOOK).await?;
        seen.push(Seen {
            pid: row.try_get(0)?,
            lock_timeout: row.try_get(1)?,
            statement_timeout: row.try_get(2)?,
            prepared: row.try_get(3)?,
            listening: row.try_get(4)?,
        });
        conns.push(conn);
    }
    for mut conn in conns {
        conn.execute("ROLLBACK").await?;
        conn.close().await?;
    }
    Ok(seen)
}
