//! What a cell cost: CPU time of PostgreSQL's processes and of the servers' threads (from
//! `/proc`), and the statements PostgreSQL ran (from `pg_stat_statements`), sampled at the start
//! and the end of the cell's measured window.

use sqlx::{Connection, PgConnection};
use std::{collections::BTreeMap, fs, path::Path};
use tokio::sync::Mutex;

/// The name of the load generator's threads (its own runtime): their CPU is not the servers'.
pub const LOAD_THREAD: &str = "load";

/// The statements of the current database so far (each statement is counted once it finished).
const STATEMENTS: &str = "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
     WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// CPU ticks (utime + stime) per process or thread id.
#[derive(Debug, Clone, Default)]
pub struct Ticks(BTreeMap<u32, u64>);

impl Ticks {
    /// Seconds spent between `self` (earlier) and `later`. An id seen only later started in
    /// between and counts whole; one seen only earlier has exited and counts nothing (its CPU
    /// up to the exit is lost, rather than subtracted).
    fn seconds_until(&self, later: &Ticks) -> f64 {
        let ticks: u64 = later
            .0
            .iter()
            .map(|(id, end)| end.saturating_sub(self.0.get(id).copied().unwrap_or(0)))
            .sum();
        ticks as f64 / clock_ticks_per_second()
    }
}

/// `sysconf(_SC_CLK_TCK)`: the unit of `/proc/<pid>/stat`'s times (100 on Linux).
fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a system constant.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as f64 } else { 100.0 }
}

/// utime + stime of `/proc/<pid>/stat` or `/proc/self/task/<tid>/stat`, if it still exists.
fn ticks_of(dir: &Path) -> Option<u64> {
    let stat = fs::read_to_string(dir.join("stat")).ok()?;
    // The name, field 2, is in parentheses and may hold spaces: count the fields after it.
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace().skip(11); // fields 3..=13
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The ids under `dir` whose `comm` satisfies `keep`, with their ticks.
fn ticks_under(dir: &str, keep: impl Fn(&str) -> bool) -> Ticks {
    let mut ticks = BTreeMap::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return Ticks(ticks);
    };
    for entry in entries.flatten() {
        let Some(id) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let path = entry.path();
        let Ok(comm) = fs::read_to_string(path.join("comm")) else {
            continue;
        };
        if keep(comm.trim_end())
            && let Some(t) = ticks_of(&path)
        {
            ticks.insert(id, t);
        }
    }
    Ticks(ticks)
}

/// Every process of this host named `postgres`; `None` if there is none (not on this host).
fn postgres_ticks() -> Option<Ticks> {
    let ticks = ticks_under("/proc", |comm| comm == "postgres");
    (!ticks.0.is_empty()).then_some(ticks)
}

/// This process's threads, except the load generator's.
fn server_ticks() -> Ticks {
    ticks_under("/proc/self/task", |comm| comm != LOAD_THREAD)
}

/// Whether this process has threads named [`LOAD_THREAD`] (the load runtime is set up right).
pub fn load_threads() -> usize {
    ticks_under("/proc/self/task", |comm| comm == LOAD_THREAD)
        .0
        .len()
}

/// The counters at one instant.
#[derive(Debug, Clone)]
pub struct Sample {
    postgres: Option<Ticks>,
    server: Ticks,
    statements: Option<i64>,
}

/// What a window cost, per request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cost {
    /// PostgreSQL's CPU seconds per 1,000 requests (`None`: no postgres process visible).
    pub postgres_cpu: Option<f64>,
    /// The servers' CPU seconds per 1,000 requests.
    pub server_cpu: f64,
    /// Statements per request (`None`: no `pg_stat_statements`).
    pub statements: Option<f64>,
}

/// Samples the counters through its own connection.
pub struct Probe {
    /// `None` if `pg_stat_statements` cannot be read.
    connection: Option<Mutex<PgConnection>>,
    /// Statements one pair of samples adds to the count (the first sample's own query).
    overhead: i64,
}

impl Probe {
    /// Connects, creates `pg_stat_statements` if missing and measures what sampling adds.
    /// Without the extension, prints a hint and counts no statements.
    pub async fn connect(database_url: &str) -> anyhow::Result<Self> {
        let mut connection = PgConnection::connect(database_url).await?;
        let created = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&mut connection)
            .await;
        let readable = match created {
            Ok(_) => sqlx::query_scalar::<_, i64>(STATEMENTS)
                .fetch_one(&mut connection)
                .await
                .map_err(anyhow::Error::from),
            Err(error) => Err(error.into()),
        };
        if let Err(error) = readable {
            eprintln!(
                "statements per request: n/a (pg_stat_statements: {error}); preload it: \
                 ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements', then restart PostgreSQL"
            );
            return Ok(Self {
                connection: None,
                overhead: 0,
            });
        }
        let mut probe = Self {
            connection: Some(Mutex::new(connection)),
            overhead: 0,
        };
        probe.overhead = probe.calibrate().await?;
        eprintln!(
            "statements per request: from pg_stat_statements, less {} per window for the sampling itself",
            probe.overhead
        );
        Ok(probe)
    }

    /// The fewest statements counted between two back-to-back samples: what sampling itself adds
    /// (other clients of the database can only add to it).
    async fn calibrate(&self) -> anyhow::Result<i64> {
        let mut counts = Vec::new();
        for _ in 0..6 {
            counts.push(self.statements().await?.unwrap_or(0));
        }
        Ok(counts
            .windows(2)
            .map(|pair| pair[1] - pair[0])
            .min()
            .unwrap_or(0))
    }

    /// Whether statements are counted (`pg_stat_statements` is readable).
    pub fn counts_statements(&self) -> bool {
        self.connection.is_some()
    }

    async fn statements(&self) -> anyhow::Result<Option<i64>> {
        let Some(connection) = &self.connection else {
            return Ok(None);
        };
        let mut connection = connection.lock().await;
        Ok(Some(
            sqlx::query_scalar(STATEMENTS)
                .fetch_one(&mut *connection)
                .await?,
        ))
    }

    /// The window's first sample: statements first, so the CPU after is not charged their query.
    pub async fn start(&self) -> anyhow::Result<Sample> {
        let statements = self.statements().await?;
        Ok(Sample {
            postgres: postgres_ticks(),
            server: server_ticks(),
            statements,
        })
    }

    /// The window's last sample: CPU first, then statements.
    pub async fn end(&self) -> anyhow::Result<Sample> {
        let (postgres, server) = (postgres_ticks(), server_ticks());
        Ok(Sample {
            postgres,
            server,
            statements: self.statements().await?,
        })
    }

    /// What happened between `start` and `end`, per request.
    pub fn cost(&self, start: &Sample, end: &Sample, requests: usize) -> Cost {
        let requests = requests.max(1) as f64;
        let postgres_cpu = match (&start.postgres, &end.postgres) {
            (Some(start), Some(end)) => Some(start.seconds_until(end) / requests * 1000.0),
            _ => None,
        };
        let statements = match (start.statements, end.statements) {
            (Some(start), Some(end)) => Some((end - start - self.overhead) as f64 / requests),
            _ => None,
        };
        Cost {
            postgres_cpu,
            server_cpu: start.server.seconds_until(&end.server) / requests * 1000.0,
            statements,
        }
    }
}
