//! The load generator: closed-loop keep-alive clients, and racers released by a barrier.

use crate::{
    orders::Order,
    probe::{Cost, Probe, Sample},
    server::{Server, USER_PREFIX},
};
use anyhow::{Context, bail};
use reqwest::header::{CONTENT_TYPE, COOKIE, HeaderMap, HeaderValue, SET_COOKIE};
use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::{sync::Barrier, task::JoinSet};

/// Unmeasured time at the start of every cell (connections open, pools fill).
const WARMUP: Duration = Duration::from_millis(500);

/// The replay headers of the three layers (ours and `idempotent`; `axum-idempotent`).
const REPLAYED: [&str; 2] = ["idempotent-replayed", "idempotency-replayed"];

/// A system and the HTTP client that drives it.
pub struct Target {
    pub server: Server,
    client: reqwest::Client,
}

/// One response, as the load generator sees it.
struct Reply {
    status: u16,
    replayed: bool,
}

impl Target {
    pub fn new(server: Server) -> Self {
        Self {
            server,
            client: reqwest::Client::new(),
        }
    }

    /// The headers a new user sends: `x-user`, and the session cookie if the system needs one.
    async fn identity(&self) -> anyhow::Result<HeaderMap> {
        let user = format!("{USER_PREFIX}{}", uuid::Uuid::new_v4().simple());
        let mut headers = HeaderMap::new();
        headers.insert("x-user", HeaderValue::from_str(&user)?);
        if self.server.login {
            let response = self
                .client
                .post(format!("{}/login", self.server.url))
                .headers(headers.clone())
                .send()
                .await?
                .error_for_status()?;
            let cookie = response
                .headers()
                .get(SET_COOKIE)
                .and_then(|cookie| cookie.to_str().ok())
                .and_then(|cookie| cookie.split(';').next())
                .context("login set no cookie")?;
            headers.insert(COOKIE, HeaderValue::from_str(cookie)?);
        }
        Ok(headers)
    }

    /// `POST /orders` with `key`; reads the whole response.
    async fn send(&self, identity: &HeaderMap, key: &str, body: &str) -> anyhow::Result<Reply> {
        let response = self
            .client
            .post(format!("{}/orders", self.server.url))
            .headers(identity.clone())
            .header("idempotency-key", key)
            .header(CONTENT_TYPE, "application/json")
            .body(body.to_owned())
            .send()
            .await?;
        let status = response.status().as_u16();
        let replayed = REPLAYED
            .iter()
            .any(|name| response.headers().get(*name).is_some_and(|v| v == "true"));
        response.bytes().await?;
        Ok(Reply { status, replayed })
    }

    /// Opens `connections` keep-alive connections (concurrent `GET /health`).
    async fn warm(&self, connections: usize) -> anyhow::Result<()> {
        let mut tasks = JoinSet::new();
        for _ in 0..connections {
            let client = self.client.clone();
            let url = format!("{}/health", self.server.url);
            tasks.spawn(async move { client.get(url).send().await?.bytes().await });
        }
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        Ok(())
    }
}

/// A new request: a fresh key, and a body with a fresh `request_id`.
fn new_request() -> (String, String) {
    let id = uuid::Uuid::new_v4().to_string();
    let body = serde_json::to_string(&Order {
        request_id: id.clone(),
        item: "tea".to_owned(),
    })
    .expect("an order serializes");
    (id, body)
}

/// What one cell measured (after the warm-up).
#[derive(Debug, Default)]
pub struct Cell {
    /// Measured wall time, seconds.
    pub seconds: f64,
    /// Latency of every measured request.
    pub latencies: Vec<Duration>,
    /// Responses by status (0: transport error).
    pub statuses: BTreeMap<u16, u64>,
    /// Responses marked as replays.
    pub replayed: u64,
    /// CPU and statements per request over the window.
    pub cost: Cost,
}

impl Cell {
    pub fn requests(&self) -> usize {
        self.latencies.len()
    }

    pub fn rate(&self) -> f64 {
        self.requests() as f64 / self.seconds
    }

    /// The `q` quantile (0..=1) of the latencies.
    pub fn latency(&self, q: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort_unstable();
        match sorted.len() {
            0 => Duration::ZERO,
            n => sorted[((n - 1) as f64 * q).round() as usize],
        }
    }

    /// Requests that did not get 201.
    pub fn not_created(&self) -> u64 {
        self.statuses
            .iter()
            .filter(|(status, _)| **status != 201)
            .map(|(_, count)| count)
            .sum()
    }

    fn merge(&mut self, other: Cell) {
        self.latencies.extend(other.latencies);
        for (status, count) in other.statuses {
            *self.statuses.entry(status).or_default() += count;
        }
        self.replayed += other.replayed;
    }
}

/// The measured window of a cell.
#[derive(Clone, Copy)]
struct Window {
    from: Instant,
    until: Instant,
}

impl Window {
    fn after_warmup(measured: Duration) -> Self {
        let from = Instant::now() + WARMUP;
        Self {
            from,
            until: from + measured,
        }
    }
}

/// One client: sends back to back until the window closes; records the requests that started
/// and finished inside it. `next` gives each request's key and body.
async fn client_loop(
    target: Arc<Target>,
    identity: HeaderMap,
    window: Window,
    mut next: impl FnMut() -> (String, String),
) -> Cell {
    let mut cell = Cell::default();
    loop {
        let (key, body) = next();
        let started = Instant::now();
        if started >= window.until {
            return cell;
        }
        let reply = target.send(&identity, &key, &body).await;
        let finished = Instant::now();
        if started >= window.from && finished <= window.until {
            cell.latencies.push(finished - started);
            let status = reply.as_ref().map_or(0, |reply| reply.status);
            *cell.statuses.entry(status).or_default() += 1;
            cell.replayed += u64::from(reply.is_ok_and(|reply| reply.replayed));
        }
    }
}

/// Samples `probe` at the start and at the end of `window`.
async fn sample(probe: Arc<Probe>, window: Window) -> anyhow::Result<(Sample, Sample)> {
    tokio::time::sleep_until(window.from.into()).await;
    let start = probe.start().await?;
    tokio::time::sleep_until(window.until.into()).await;
    Ok((start, probe.end().await?))
}

/// Runs one closed-loop client per (identity, request maker) for `measured` after the warm-up,
/// and samples `probe` over the measured window.
async fn closed_loop<F>(
    target: &Arc<Target>,
    clients: Vec<(HeaderMap, F)>,
    measured: Duration,
    probe: &Arc<Probe>,
) -> anyhow::Result<Cell>
where
    F: FnMut() -> (String, String) + Send + 'static,
{
    let window = Window::after_warmup(measured);
    let sampler = tokio::spawn(sample(probe.clone(), window));
    let mut tasks = JoinSet::new();
    for (identity, next) in clients {
        tasks.spawn(client_loop(target.clone(), identity, window, next));
    }
    let mut cell = Cell {
        seconds: measured.as_secs_f64(),
        ..Cell::default()
    };
    while let Some(client) = tasks.join_next().await {
        cell.merge(client?);
    }
    let (start, end) = sampler.await??;
    cell.cost = probe.cost(&start, &end, cell.requests());
    Ok(cell)
}

/// Fresh keys: `clients` users, each sending new requests back to back.
pub async fn fresh(
    target: &Arc<Target>,
    clients: usize,
    measured: Duration,
    probe: &Arc<Probe>,
) -> anyhow::Result<Cell> {
    let mut loops = Vec::with_capacity(clients);
    for _ in 0..clients {
        loops.push((target.identity().await?, new_request));
    }
    closed_loop(target, loops, measured, probe).await
}

/// A replay cell, and whether the replays were replays.
pub struct Replay {
    pub cell: Cell,
    /// Rows the handler wrote while the clients were replaying (should be 0).
    pub new_rows: i64,
}

/// Replays: each of `clients` users sends one request, then repeats it (same key, same body)
/// back to back.
pub async fn replay(
    target: &Arc<Target>,
    clients: usize,
    measured: Duration,
    probe: &Arc<Probe>,
) -> anyhow::Result<Replay> {
    let mut firsts = JoinSet::new();
    for _ in 0..clients {
        let target = target.clone();
        firsts.spawn(async move {
            let identity = target.identity().await?;
            let (key, body) = new_request();
            let reply = target.send(&identity, &key, &body).await?;
            if reply.status != 201 {
                bail!("{}: first request got {}", target.server.name, reply.status);
            }
            anyhow::Ok((identity, move || (key.clone(), body.clone())))
        });
    }
    let mut loops = Vec::with_capacity(clients);
    while let Some(first) = firsts.join_next().await {
        loops.push(first??);
    }
    let before = target.server.orders.count().await?;
    let cell = closed_loop(target, loops, measured, probe).await?;
    let new_rows = target.server.orders.count().await? - before;
    Ok(Replay { cell, new_rows })
}

/// What the racers did.
#[derive(Debug, Default)]
pub struct Race {
    pub trials: usize,
    /// Trials whose request ran more than once.
    pub doubled: usize,
    /// The most rows one trial's request wrote.
    pub max_executions: i64,
    /// Trials whose request ran not at all.
    pub lost: usize,
    /// The racers' responses by status (0: transport error) and whether marked replayed.
    pub statuses: BTreeMap<(u16, bool), u64>,
}

/// `trials` times, `racers` tasks of one user send the same new request at once (released by a
/// barrier); then the rows with its `request_id` are counted.
pub async fn race(target: &Arc<Target>, racers: usize, trials: usize) -> anyhow::Result<Race> {
    let identity = Arc::new(target.identity().await?);
    target.warm(racers).await?;
    let mut race = Race {
        trials,
        ..Race::default()
    };
    for _ in 0..trials {
        let (key, body) = new_request();
        let request_id = key.clone();
        let (key, body) = (Arc::new(key), Arc::new(body));
        let barrier = Arc::new(Barrier::new(racers));
        let mut tasks = JoinSet::new();
        for _ in 0..racers {
            let (target, identity) = (target.clone(), identity.clone());
            let (key, body, barrier) = (key.clone(), body.clone(), barrier.clone());
            tasks.spawn(async move {
                barrier.wait().await;
                let reply = target.send(&identity, &key, &body).await;
                reply.map_or((0, false), |reply| (reply.status, reply.replayed))
            });
        }
        while let Some(status) = tasks.join_next().await {
            *race.statuses.entry(status?).or_default() += 1;
        }
        let executions = target.server.orders.count_request(&request_id).await?;
        race.doubled += usize::from(executions > 1);
        race.lost += usize::from(executions == 0);
        race.max_executions = race.max_executions.max(executions);
    }
    Ok(race)
}
