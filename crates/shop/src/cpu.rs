//! CPU time of the database server's processes and of the shop's threads, from `/proc`, for the
//! benchmark: sampled at the start and the end of each measured window. The load generator runs
//! on its own runtime, whose threads are named [`LOAD_THREAD`]; the shop's CPU is that of every
//! other thread of this process (its runtime, SQLite's worker threads, the maintenance worker).

use std::{collections::BTreeMap, fs, path::Path};

/// The name of the load generator's threads: their CPU is not the shop's.
pub(crate) const LOAD_THREAD: &str = "load";

/// CPU ticks (utime + stime) per process or thread id.
#[derive(Debug, Clone, Default)]
struct Ticks(BTreeMap<u32, u64>);

impl Ticks {
    /// Seconds spent between `self` (earlier) and `later`. An id seen only later started in
    /// between and counts whole; one seen only earlier has exited and counts nothing.
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
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf takes no pointers and only reads a system constant.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

/// The unit of `/proc/<pid>/stat`'s times where `sysconf` is not at hand.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn clock_ticks_per_second() -> f64 {
    100.0
}

/// utime + stime of `<dir>/stat`, if it still exists.
fn ticks_of(dir: &Path) -> Option<u64> {
    parse_ticks(&fs::read_to_string(dir.join("stat")).ok()?)
}

/// utime + stime of one `stat` line.
fn parse_ticks(stat: &str) -> Option<u64> {
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
        if keep(comm.trim_end()) {
            if let Some(t) = ticks_of(&path) {
                ticks.insert(id, t);
            }
        }
    }
    Ticks(ticks)
}

/// The threads of this process named [`LOAD_THREAD`] (0: the load runtime is not set up).
pub(crate) fn load_threads() -> usize {
    ticks_under("/proc/self/task", |comm| comm == LOAD_THREAD)
        .0
        .len()
}

/// Which database server's processes to sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Server {
    /// Processes named `postgres`.
    Postgres,
    /// Processes named `mariadbd` or `mysqld`.
    MariaDb,
    /// None: the database runs inside the shop (SQLite).
    InProcess,
}

impl Server {
    /// The server's processes on this host; `None` in process or if none is visible.
    fn ticks(self) -> Option<Ticks> {
        let ticks = match self {
            Server::Postgres => ticks_under("/proc", |comm| comm == "postgres"),
            Server::MariaDb => ticks_under("/proc", |comm| comm == "mariadbd" || comm == "mysqld"),
            Server::InProcess => return None,
        };
        (!ticks.0.is_empty()).then_some(ticks)
    }
}

/// The counters at one instant.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    database: Option<Ticks>,
    shop: Ticks,
}

impl Sample {
    /// Samples `server`'s processes and this process's threads but the load generator's.
    pub(crate) fn take(server: Server) -> Self {
        Self {
            database: server.ticks(),
            shop: ticks_under("/proc/self/task", |comm| comm != LOAD_THREAD),
        }
    }

    /// CPU seconds spent between `self` (earlier) and `later`.
    pub(crate) fn until(&self, later: &Sample) -> Spent {
        Spent {
            database: match (&self.database, &later.database) {
                (Some(start), Some(end)) => Some(start.seconds_until(end)),
                _ => None,
            },
            shop: self.shop.seconds_until(&later.shop),
        }
    }
}

/// CPU seconds spent in a window.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Spent {
    /// The database server's processes (`None`: in process, or not visible from here).
    pub(crate) database: Option<f64>,
    /// The shop's threads.
    pub(crate) shop: f64,
}

impl std::ops::AddAssign for Spent {
    fn add_assign(&mut self, other: Spent) {
        self.database = match (self.database, other.database) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        self.shop += other.shop;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_times_are_read_after_a_name_with_spaces_and_parentheses() {
        let stat = "4242 (tokio (x) 1) S 1 4242 4242 0 -1 4194560 611 0 0 0 37 5 0 0 20 0 9 0";
        assert_eq!(parse_ticks(stat), Some(42));
        assert_eq!(parse_ticks("4242 (short) S 1"), None);
    }

    #[test]
    fn a_new_id_counts_whole_and_an_exited_one_nothing() {
        let start = Ticks(BTreeMap::from([(1, 100), (2, 50)]));
        let end = Ticks(BTreeMap::from([(1, 130), (3, 20)]));
        let seconds = start.seconds_until(&end);
        let ticks = (seconds * clock_ticks_per_second()).round();
        assert_eq!(ticks, 50.0);
    }

    #[test]
    fn the_load_threads_are_found_by_name() {
        let (ready, wait) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let load = std::thread::Builder::new()
            .name(LOAD_THREAD.to_owned())
            .spawn(move || {
                ready.send(()).expect("ready");
                stopped.recv().ok();
            })
            .expect("thread");
        wait.recv().expect("started");
        let seen = load_threads();
        let sample = Sample::take(Server::InProcess);
        stop.send(()).expect("stop");
        load.join().expect("joined");
        assert!(seen >= 1, "{seen}");
        assert!(sample.database.is_none());
        assert!(!sample.shop.0.is_empty());
    }

    #[test]
    fn spent_adds_up_and_keeps_a_missing_database_missing() {
        let mut total = Spent::default();
        total += Spent {
            database: None,
            shop: 1.0,
        };
        assert_eq!(total.database, None);
        total += Spent {
            database: Some(2.0),
            shop: 0.5,
        };
        assert_eq!((total.database, total.shop), (Some(2.0), 1.5));
    }
}
