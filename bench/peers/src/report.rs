//! The results, as Markdown: raw cells, ratios to the baseline of the same round, racers.

use crate::{
    load::{Cell, Race},
    probe::Cost,
    server::PoolSettings,
};
use std::{collections::BTreeMap, fmt::Write as _, time::Duration};

/// What a cell measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// New key and body on every request.
    Fresh { clients: usize },
    /// The same request again and again, after a first one.
    Replay { clients: usize },
}

impl Kind {
    pub fn label(self) -> String {
        match self {
            Kind::Fresh { clients: 1 } => "fresh key, 1 client".to_owned(),
            Kind::Fresh { clients } => format!("fresh key, {clients} clients"),
            Kind::Replay { clients } => format!("replay, {clients} clients"),
        }
    }

    /// The baseline cell this one is divided by: unprotected, fresh, as many clients.
    fn baseline(self) -> Kind {
        match self {
            Kind::Fresh { clients } | Kind::Replay { clients } => Kind::Fresh { clients },
        }
    }
}

/// One measured cell.
pub struct Measured {
    pub round: usize,
    pub system: &'static str,
    pub kind: Kind,
    pub cell: Cell,
    /// For replays: rows written during the replay phase.
    pub new_rows: Option<i64>,
}

impl Measured {
    /// One line, for progress.
    pub fn line(&self) -> String {
        let cost = &self.cell.cost;
        format!(
            "round {} {:>15} {:<22} {:>8.1} req/s  p50 {}  p99 {}  CPU s/1k req: pg {} server {:.3}  statements/req {}  {}",
            self.round + 1,
            self.system,
            self.kind.label(),
            self.cell.rate(),
            ms(self.cell.latency(0.5)),
            ms(self.cell.latency(0.99)),
            optional(cost.postgres_cpu, 3),
            cost.server_cpu,
            optional(cost.statements, 2),
            statuses(&self.cell.statuses),
        )
    }

    /// What looks wrong with this cell.
    fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        let at = format!(
            "round {} {} {}",
            self.round + 1,
            self.system,
            self.kind.label()
        );
        if self.cell.not_created() > 0 {
            warnings.push(format!(
                "{at}: {} of {} responses were not 201 ({})",
                self.cell.not_created(),
                self.cell.requests(),
                statuses(&self.cell.statuses)
            ));
        }
        if let Some(rows) = self.new_rows.filter(|rows| *rows != 0) {
            warnings.push(format!(
                "{at}: {rows} new rows during the replays (not replays)"
            ));
        }
        let requests = self.cell.requests() as u64;
        if matches!(self.kind, Kind::Replay { .. }) && self.cell.replayed < requests {
            warnings.push(format!(
                "{at}: {} of {requests} responses carry no replay header",
                requests - self.cell.replayed
            ));
        }
        warnings
    }
}

/// Everything one run measured.
pub struct Report {
    /// The pools' settings.
    pub pool: PoolSettings,
    /// Whether `pg_stat_statements` was readable.
    pub statements: bool,
    pub rounds: usize,
    /// The systems compared with the baseline, in the order of the first round.
    pub systems: Vec<&'static str>,
    pub kinds: Vec<Kind>,
    pub measured: Vec<Measured>,
    pub racers: usize,
    pub races: Vec<(&'static str, Race)>,
}

impl Report {
    /// A figure of `system`'s cell per round, and the same over the baseline's (same round,
    /// [`Kind::baseline`]).
    fn costs(
        &self,
        system: &str,
        kind: Kind,
        figure: impl Fn(&Cost) -> Option<f64>,
    ) -> (Vec<f64>, Vec<f64>) {
        let (mut values, mut ratios) = (Vec::new(), Vec::new());
        for round in 0..self.rounds {
            let Some(value) = self.cell(round, system, kind).and_then(|c| figure(&c.cost)) else {
                continue;
            };
            values.push(value);
            let baseline = self.cell(round, "baseline", kind.baseline());
            if let Some(base) = baseline.and_then(|c| figure(&c.cost)).filter(|b| *b > 0.0) {
                ratios.push(value / base);
            }
        }
        (values, ratios)
    }

    fn cell(&self, round: usize, system: &str, kind: Kind) -> Option<&Cell> {
        self.measured
            .iter()
            .find(|m| m.round == round && m.system == system && m.kind == kind)
            .map(|m| &m.cell)
    }

    /// `system`'s rate over the baseline's, per round.
    fn ratios(&self, system: &str, kind: Kind) -> Vec<f64> {
        (0..self.rounds)
            .filter_map(|round| {
                let cell = self.cell(round, system, kind)?;
                let baseline = self.cell(round, "baseline", kind.baseline())?;
                Some(cell.rate() / baseline.rate())
            })
            .collect()
    }

    /// The whole report.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# Peers benchmark\n\nPools: {}. Statements per request: {}.\n",
            self.pool.describe(),
            if self.statements {
                "from `pg_stat_statements`"
            } else {
                "n/a (`pg_stat_statements` not loaded)"
            }
        );
        self.raw(&mut out);
        self.per_round(&mut out);
        self.cost_table(&mut out);
        self.race_table(&mut out);
        self.summary(&mut out);
        out
    }

    fn raw(&self, out: &mut String) {
        out.push_str("## Raw cells\n\n| round | system | cell | req/s | p50 | p99 | statuses |\n|---|---|---|---|---|---|---|\n");
        for m in &self.measured {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.1} | {} | {} | {} |",
                m.round + 1,
                m.system,
                m.kind.label(),
                m.cell.rate(),
                ms(m.cell.latency(0.5)),
                ms(m.cell.latency(0.99)),
                statuses(&m.cell.statuses),
            );
        }
        let warnings: Vec<String> = self.measured.iter().flat_map(Measured::warnings).collect();
        for warning in &warnings {
            let _ = writeln!(out, "\n**warning**: {warning}");
        }
        out.push('\n');
    }

    fn per_round(&self, out: &mut String) {
        out.push_str("## Ratio to the baseline of the same round\n\n| system | cell |");
        for round in 0..self.rounds {
            let _ = write!(out, " round {} |", round + 1);
        }
        out.push_str(" mean |\n|---|---|");
        out.push_str(&"---|".repeat(self.rounds + 1));
        out.push('\n');
        for system in &self.systems {
            for kind in &self.kinds {
                let ratios = self.ratios(system, *kind);
                let _ = write!(out, "| {system} | {} |", kind.label());
                for ratio in &ratios {
                    let _ = write!(out, " {ratio:.2}× |");
                }
                let _ = writeln!(out, " {} |", mean_range(&ratios));
            }
        }
        out.push('\n');
    }

    fn cost_table(&self, out: &mut String) {
        out.push_str(
            "## CPU and statements per request (mean (min–max) over rounds; × the baseline's of the same round)\n\n\
             | system | cell | PostgreSQL CPU s / 1,000 req | × baseline | server CPU s / 1,000 req | × baseline | statements / req |\n\
             |---|---|--:|--:|--:|--:|--:|\n",
        );
        let systems = std::iter::once("baseline").chain(self.systems.iter().copied());
        for system in systems {
            for kind in &self.kinds {
                if system == "baseline" && matches!(kind, Kind::Replay { .. }) {
                    continue;
                }
                let (pg, pg_ratio) = self.costs(system, *kind, |c| c.postgres_cpu);
                let (server, server_ratio) = self.costs(system, *kind, |c| Some(c.server_cpu));
                let (statements, _) = self.costs(system, *kind, |c| c.statements);
                let ratio = |ratios: &[f64]| {
                    if system == "baseline" {
                        "–".to_owned()
                    } else {
                        spread(ratios, 2, "×")
                    }
                };
                let _ = writeln!(
                    out,
                    "| {system} | {} | {} | {} | {} | {} | {} |",
                    kind.label(),
                    spread(&pg, 3, ""),
                    ratio(&pg_ratio),
                    spread(&server, 3, ""),
                    ratio(&server_ratio),
                    spread(&statements, 2, ""),
                );
            }
        }
        out.push_str(
            "\nThe replay rows' ratios are to the baseline's fresh cell with as many clients.\n\n",
        );
    }

    fn race_table(&self, out: &mut String) {
        let _ = write!(
            out,
            "## {} racers per trial (same key, same body, released together)\n\n\
             | system | doubled trials | max executions in one trial | trials with no execution | racers' statuses |\n\
             |---|---|---|---|---|\n",
            self.racers
        );
        for (system, race) in &self.races {
            let _ = writeln!(
                out,
                "| {system} | {} / {} | {} | {} | {} |",
                race.doubled,
                race.trials,
                race.max_executions,
                race.lost,
                race_statuses(&race.statuses)
            );
        }
        out.push('\n');
    }

    fn summary(&self, out: &mut String) {
        out.push_str("## Summary (× the unprotected baseline of the same round, fresh keys; mean and range)\n\n| system |");
        for kind in &self.kinds {
            match kind {
                Kind::Replay { .. } => {
                    let _ = write!(out, " {} (× baseline) |", kind.label());
                }
                Kind::Fresh { .. } => {
                    let _ = write!(out, " {} |", kind.label());
                }
            }
        }
        let _ = write!(
            out,
            " doubled under {} racers |\n|---|{}---|\n",
            self.racers,
            "---|".repeat(self.kinds.len())
        );
        for system in &self.systems {
            let _ = write!(out, "| {system} |");
            for kind in &self.kinds {
                let _ = write!(out, " {} |", mean_range(&self.ratios(system, *kind)));
            }
            match self.races.iter().find(|(name, _)| name == system) {
                Some((_, race)) => {
                    let _ = writeln!(
                        out,
                        " {} / {} (max {} runs) |",
                        race.doubled, race.trials, race.max_executions
                    );
                }
                None => out.push_str(" – |\n"),
            }
        }
    }
}

/// `201×200 201 replayed×26 409×2974`.
fn race_statuses(statuses: &BTreeMap<(u16, bool), u64>) -> String {
    let parts: Vec<String> = statuses
        .iter()
        .map(|((status, replayed), count)| match (status, replayed) {
            (0, _) => format!("error×{count}"),
            (status, true) => format!("{status} replayed×{count}"),
            (status, false) => format!("{status}×{count}"),
        })
        .collect();
    parts.join(" ")
}

/// `0.81× (0.79–0.83)`; one value alone without the range.
fn mean_range(values: &[f64]) -> String {
    spread(values, 2, "×")
}

/// `0.812 (0.790–0.830)` with `decimals` and `unit` after the mean; one value alone without
/// the range; none: `n/a`.
fn spread(values: &[f64], decimals: usize, unit: &str) -> String {
    if values.is_empty() {
        return "n/a".to_owned();
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    if values.len() == 1 {
        return format!("{mean:.decimals$}{unit}");
    }
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{mean:.decimals$}{unit} ({min:.decimals$}–{max:.decimals$})")
}

/// A figure, or `n/a`.
fn optional(value: Option<f64>, decimals: usize) -> String {
    value.map_or("n/a".to_owned(), |value| format!("{value:.decimals$}"))
}

/// Milliseconds, two decimals.
fn ms(duration: Duration) -> String {
    format!("{:.2} ms", duration.as_secs_f64() * 1000.0)
}

/// `201×3150 409×50`; status 0 is a transport error.
fn statuses(statuses: &BTreeMap<u16, u64>) -> String {
    let parts: Vec<String> = statuses
        .iter()
        .map(|(status, count)| match status {
            0 => format!("error×{count}"),
            status => format!("{status}×{count}"),
        })
        .collect();
    parts.join(" ")
}
