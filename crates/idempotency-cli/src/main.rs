//! `idem`: the operator's tool for the idempotency key table.
//!
//! ```text
//! idem --database-url postgres://idem@db/shop migrate
//! idem keys list --state needs-review --older-than 5m
//! idem keys show user-42 charge 8e03978e --json
//! idem keys resolve user-42 charge 8e03978e --failed --reason "no charge at the provider"
//! idem keys history user-42 charge 8e03978e
//! idem keys hand-back user-42 charge 8e03978e --reason "provider was down; ask again"
//! idem recover --interval 30s --max-attempts 5
//! idem purge --dry-run
//! idem stats --json
//! IDEM_CONSOLE_PASSWORD=… idem console --allow-actions
//! ```
//!
//! Exit codes: 0 success, 1 a runtime failure (database unreachable, key not found, not parked),
//! 2 bad input (from clap, or an unreadable or non-JSON result file).

mod console;
mod db;
mod render;

use anyhow::{bail, Context, Result};
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use db::{AnyStore, DatabaseUrl};
use idempotency::{
    maintenance::{KeyFilter, OperatorNote, Purge, Recovery, RecoveryReport, Resolution},
    store::{Journal, KeyState, Maintenance},
    IdempotencyKey,
};
use indicatif::{ProgressBar, ProgressStyle};
use std::{io::IsTerminal, path::PathBuf, process::ExitCode, time::Duration};

/// Operate the idempotency key table: migrate, inspect, resolve, recover and purge keys.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, propagate_version = true)]
struct Cli {
    /// postgres://, sqlite: or mysql:// URL of the database holding the keys.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        global = true,
        value_name = "URL"
    )]
    database_url: Option<DatabaseUrl>,

    /// How long to wait for a database connection.
    #[arg(long, global = true, default_value = "10s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    connect_timeout: Duration,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or upgrade the key table (safe to run again, and from several hosts at once).
    Migrate,
    /// List, inspect and resolve keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Recover keys whose worker vanished: release local ones, park external ones as
    /// needs_review (the CLI has no provider to ask).
    Recover(RecoverArgs),
    /// Delete completed and failed keys past their retention, in bounded batches.
    Purge(PurgeArgs),
    /// Counts by state and operation, oldest pending key, expired leases, purgeable rows.
    Stats(JsonFlag),
    /// Serve the review console: a web page to inspect keys and settle those needing review.
    /// The password comes from IDEM_CONSOLE_PASSWORD or --password-file.
    Console(console::ConsoleArgs),
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Keys matching the filters, oldest first.
    List(ListArgs),
    /// One key in full.
    Show {
        #[command(flatten)]
        key: KeyArgs,
        #[command(flatten)]
        json: JsonFlag,
    },
    /// Settle a key parked as needs_review: it completed (with its result) or it failed.
    Resolve(ResolveArgs),
    /// What happened to a key, oldest first: reserved, steps, outside calls, claims, parking,
    /// resolution.
    History {
        #[command(flatten)]
        key: KeyArgs,
        /// At most this many events (the newest).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[command(flatten)]
        json: JsonFlag,
    },
    /// Hand a key parked as needs_review back to the resumer, which asks the provider again.
    HandBack(HandBackArgs),
}

#[derive(Debug, Args)]
struct HandBackArgs {
    #[command(flatten)]
    key: KeyArgs,
    /// Why (kept on the row and in the key's history).
    #[arg(long, required = true)]
    reason: String,
    #[command(flatten)]
    operator: OperatorArgs,
    #[command(flatten)]
    json: JsonFlag,
}

#[derive(Debug, Args)]
struct JsonFlag {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct KeyArgs {
    /// Who the key belongs to.
    scope: String,
    /// The operation it protects.
    operation: String,
    /// The client's key.
    key: String,
}

impl KeyArgs {
    fn key(&self) -> Result<IdempotencyKey> {
        IdempotencyKey::new(&self.scope, &self.operation, &self.key)
            .map_err(|e| usage(&format!("invalid key: {e}")))
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum StateArg {
    Pending,
    Completed,
    #[value(name = "needs-review", alias = "needs_review")]
    NeedsReview,
    Failed,
}

impl From<StateArg> for KeyState {
    fn from(state: StateArg) -> Self {
        match state {
            StateArg::Pending => KeyState::Pending,
            StateArg::Completed => KeyState::Completed,
            StateArg::NeedsReview => KeyState::NeedsReview,
            StateArg::Failed => KeyState::Failed,
        }
    }
}

#[derive(Debug, Args)]
struct ListArgs {
    /// Only keys in this state.
    #[arg(long, value_enum)]
    state: Option<StateArg>,
    /// Only keys of this scope.
    #[arg(long)]
    scope: Option<String>,
    /// Only keys of this operation.
    #[arg(long)]
    operation: Option<String>,
    /// Only keys created at least this long ago (by the database clock), e.g. 5m, 24h, 7d.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    older_than: Option<Duration>,
    /// At most this many keys.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    #[command(flatten)]
    json: JsonFlag,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("resolution").required(true).args(["completed_with", "failed"])))]
struct ResolveArgs {
    #[command(flatten)]
    key: KeyArgs,
    /// It happened: store the JSON in FILE ("-" for standard input) as the key's result.
    #[arg(long, value_name = "FILE")]
    completed_with: Option<PathBuf>,
    /// It did not happen: the key may be reserved again.
    #[arg(long)]
    failed: bool,
    /// Why (kept on the row and in the key's history).
    #[arg(long, required = true)]
    reason: String,
    #[command(flatten)]
    operator: OperatorArgs,
    /// How long to keep the resolved key.
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    retention: Duration,
    #[command(flatten)]
    json: JsonFlag,
}

/// Who takes an operator action, and on what evidence (recorded in the key's history).
#[derive(Debug, Args)]
struct OperatorArgs {
    /// Who acts (recorded in the key's history); default: $USER, else "operator".
    #[arg(long)]
    operator: Option<String>,
    /// What the decision rests on, e.g. a provider dashboard link (recorded in the history).
    #[arg(long)]
    evidence: Option<String>,
}

impl OperatorArgs {
    /// The note of an action taken for `reason`.
    fn note(&self, reason: &str) -> OperatorNote {
        let operator = self
            .operator
            .clone()
            .or_else(|| {
                std::env::var("USER")
                    .ok()
                    .filter(|user| !user.trim().is_empty())
            })
            .unwrap_or_else(|| "operator".to_owned());
        let note = OperatorNote::new(operator, reason);
        match &self.evidence {
            Some(evidence) => note.with_evidence(evidence.clone()),
            None => note,
        }
    }
}

#[derive(Debug, Args)]
struct RecoverArgs {
    /// Run one pass and exit.
    #[arg(long)]
    once: bool,
    /// Time between passes.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// "Unknown" answers before an external key is parked (without a resolver, at once).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    max_attempts: u32,
    /// Keys looked at per pass.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
    #[command(flatten)]
    json: JsonFlag,
}

#[derive(Debug, Args)]
struct PurgeArgs {
    /// Only count what would be deleted.
    #[arg(long)]
    dry_run: bool,
    /// Rows per DELETE statement.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
    /// Pause between batches (room for other writers).
    #[arg(long, default_value = "10ms", value_parser = humantime::parse_duration)]
    pause: Duration,
    #[command(flatten)]
    json: JsonFlag,
}

/// Bad input found after parsing: reported like clap's errors, exit code 2.
#[derive(Debug)]
struct Usage(String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

fn usage(message: &str) -> anyhow::Error {
    Usage(message.to_owned()).into()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IDEM_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if error.is::<Usage>() => {
            eprintln!("error: {error}");
            ExitCode::from(2)
        }
        Err(error) => {
            eprintln!("error: {}", chain(&error));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, without causes that repeat the text before them (sqlx errors embed
/// their source in their own message).
fn chain(error: &anyhow::Error) -> String {
    let mut message = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if !message.contains(&text) {
            if !message.is_empty() {
                message.push_str(": ");
            }
            message.push_str(&text);
        }
    }
    message
}

async fn run(cli: Cli) -> Result<()> {
    let Some(url) = cli.database_url else {
        Cli::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                "the database is not named: pass --database-url URL or set DATABASE_URL",
            )
            .exit();
    };
    // Input that needs no database is checked before connecting.
    if let Command::Keys(KeysCommand::Resolve(args)) = &cli.command {
        args.key.key()?;
        if args.reason.trim().is_empty() {
            return Err(usage("--reason must not be empty"));
        }
        if args.operator.operator.as_deref().map(str::trim) == Some("") {
            return Err(usage("--operator must not be empty"));
        }
    }
    if let Command::Console(args) = &cli.command {
        args.secret().map_err(|e| usage(&format!("{e:#}")))?;
    }
    if let Command::Keys(KeysCommand::HandBack(args)) = &cli.command {
        args.key.key()?;
        if args.reason.trim().is_empty() {
            return Err(usage("--reason must not be empty"));
        }
        if args.operator.operator.as_deref().map(str::trim) == Some("") {
            return Err(usage("--operator must not be empty"));
        }
    }
    let create = matches!(cli.command, Command::Migrate);
    let store = db::connect(&url, cli.connect_timeout, create).await?;
    dispatch(&store, cli.command).await
}

async fn dispatch(store: &AnyStore, command: Command) -> Result<()> {
    with_store!(store, s => execute(s, command).await)
}

async fn execute<S: Maintenance + Journal>(store: &S, command: Command) -> Result<()> {
    match command {
        Command::Migrate => {
            store.migrate().await.context("migration failed")?;
            println!("the key table is up to date");
        }
        Command::Keys(KeysCommand::List(args)) => list(store, args).await?,
        Command::Keys(KeysCommand::Show { key, json }) => {
            let key = key.key()?;
            let Some(record) = store.find(&key).await? else {
                bail!("no key {key}");
            };
            if json.json {
                println!("{:#}", render::record_json(&record));
            } else {
                println!("{}", render::record_table(&record));
            }
        }
        Command::Keys(KeysCommand::Resolve(args)) => resolve(store, args).await?,
        Command::Keys(KeysCommand::History { key, limit, json }) => {
            let key = key.key()?;
            let events = store.history(&key, limit).await?;
            if events.is_empty() && store.find(&key).await?.is_none() {
                bail!("no key {key} and no history for it");
            }
            if json.json {
                println!("{:#}", render::history_json(&events));
            } else {
                println!("{}", render::history_table(&events));
            }
        }
        Command::Keys(KeysCommand::HandBack(args)) => {
            let key = args.key.key()?;
            let note = args.operator.note(&args.reason);
            let record = idempotency::maintenance::hand_back(store, &key, &note).await?;
            if args.json.json {
                println!("{:#}", render::record_json(&record));
            } else {
                println!("handed {key} back to the resumer: {}", args.reason.trim());
            }
        }
        Command::Recover(args) => recover(store, args).await?,
        Command::Purge(args) => purge(store, args).await?,
        Command::Console(args) => console::serve(store.clone(), args, shutdown()).await?,
        Command::Stats(json) => {
            let stats = store.stats().await?;
            if json.json {
                println!("{:#}", render::stats_json(&stats));
            } else {
                println!("{}", render::stats_table(&stats));
            }
        }
    }
    Ok(())
}

async fn list<S: Maintenance>(store: &S, args: ListArgs) -> Result<()> {
    let mut filter = KeyFilter::default().with_limit(args.limit);
    if let Some(state) = args.state {
        filter = filter.with_state(KeyState::from(state));
    }
    if let Some(scope) = args.scope {
        filter = filter.with_scope(scope);
    }
    if let Some(operation) = args.operation {
        filter = filter.with_operation(operation);
    }
    if let Some(age) = args.older_than {
        filter = filter.with_older_than(age);
    }
    let records = store.list(&filter).await?;
    if args.json.json {
        let rows: Vec<_> = records.iter().map(render::record_json).collect();
        println!("{:#}", serde_json::Value::Array(rows));
    } else {
        println!("{}", render::records_table(&records));
    }
    Ok(())
}

fn read_result(path: &PathBuf) -> Result<Vec<u8>> {
    let bytes = if path.as_os_str() == "-" {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes).map_err(|e| {
            usage(&format!(
                "could not read the result from standard input: {e}"
            ))
        })?;
        bytes
    } else {
        std::fs::read(path)
            .map_err(|e| usage(&format!("could not read {}: {e}", path.display())))?
    };
    // Replays decode the stored result as JSON: refuse anything else.
    serde_json::from_slice::<serde_json::Value>(&bytes)
        .map_err(|e| usage(&format!("{} is not JSON: {e}", path.display())))?;
    Ok(bytes)
}

async fn resolve<S: Maintenance>(store: &S, args: ResolveArgs) -> Result<()> {
    let key = args.key.key()?;
    let resolution = match &args.completed_with {
        Some(path) => Resolution::Completed(read_result(path)?),
        None => Resolution::Failed,
    };
    let note = args.operator.note(&args.reason);
    let record =
        idempotency::maintenance::resolve(store, &key, &resolution, &note, args.retention).await?;
    if args.json.json {
        println!("{:#}", render::record_json(&record));
    } else {
        println!("resolved {key} as {}: {}", record.state, args.reason.trim());
    }
    Ok(())
}

async fn recover<S: Maintenance + Journal>(store: &S, args: RecoverArgs) -> Result<()> {
    let recovery = Recovery::new(store.clone())
        .with_max_attempts(args.max_attempts)
        .with_batch(args.batch);
    let print = |report: &RecoveryReport| {
        if args.json.json {
            println!("{}", render::recovery_json(report));
        } else {
            println!("recovery pass: {report}");
        }
    };
    if args.once {
        let report = recovery.run_once().await?;
        print(&report);
        return Ok(());
    }
    eprintln!(
        "recovering every {} (Ctrl-C to stop)",
        humantime::format_duration(args.interval)
    );
    let total = recovery
        .run_with(args.interval, shutdown(), |pass| match pass {
            Ok(report)
                if report.acted() + report.unknown + report.skipped + report.unregistered > 0 =>
            {
                print(report)
            }
            Ok(_) => {}
            Err(error) => eprintln!("recovery pass failed (retrying): {error}"),
        })
        .await?;
    eprintln!("stopped; in total: {total}");
    Ok(())
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown() {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

async fn purge<S: Maintenance>(store: &S, args: PurgeArgs) -> Result<()> {
    let purge = Purge::new(store.clone())
        .with_batch(args.batch)
        .with_pause(args.pause);
    let purgeable = purge.count().await?;
    if args.dry_run {
        if args.json.json {
            println!("{}", serde_json::json!({"would_delete": purgeable}));
        } else {
            println!("{purgeable} expired key(s) would be deleted");
        }
        return Ok(());
    }
    let bar = if std::io::stderr().is_terminal() && purgeable > u64::from(args.batch) {
        let bar = ProgressBar::new(purgeable);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} purging [{bar:40}] {pos}/{len} rows ({per_sec}, {eta} left)",
            )
            .expect("progress template")
            .progress_chars("=> "),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    // Rows that expire during the purge are deleted too; the bar grows to fit.
    let report = purge
        .run(|deleted| {
            if deleted > bar.length().unwrap_or(0) {
                bar.set_length(deleted);
            }
            bar.set_position(deleted);
        })
        .await?;
    bar.finish_and_clear();
    if args.json.json {
        println!("{}", render::purge_json(&report));
    } else {
        println!(
            "deleted {} expired key(s) in {} batch(es) in {}",
            report.deleted,
            report.batches,
            render::duration(report.elapsed)
        );
    }
    Ok(())
}
