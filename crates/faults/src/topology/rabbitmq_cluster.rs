//! The `rabbitmq-cluster` topology: the shop's purchase events on a three-node RabbitMQ cluster
//! (`.ci/topology/rabbitmq-cluster.sh up`) with quorum queues, while a node is SIGKILLed and
//! started again, several times.
//!
//! The shop's database is a fresh one on the shared PostgreSQL (`topo_rmq_…`). The shop relays
//! its outbox to the cluster (publisher confirms) and `shop worker` consumes the events, both
//! given the three nodes' URLs (the worker's list starts at the second node, so the two clients
//! start on different nodes). Purchases go on all along; before each kill the cluster is whole
//! again (three nodes running, the queue's three members online), and the victim is the queue's
//! leader when a client is connected to it, otherwise a node a client is connected to. Once the
//! traffic stopped and everything drained, from the database and the broker:
//! * every paid purchase's event took effect exactly once: one grant of points, one receipt at
//!   the mail provider (which has no idempotency keys: a doubled event would send two);
//! * nothing was lost: a grant and a completed worker key for every purchase, the outbox
//!   empty, the queue drained, no dead letter;
//! * the purchases themselves hold (the fault proof's usual checks: no double charge, every 201
//!   answered is in the database, no key left pending);
//! * the clients did move: the relay and the worker reconnected at least once per kill.

use crate::{
    checks::Tally as PurchaseTally,
    client::{purchase_until_settled, OpReport, Settled},
    command,
    consumer_kill9::{self, WorkerProcess},
    scenarios::{self, Env},
    shop_process::ShopProcess,
};
use anyhow::{bail, ensure, Context, Result};
use idempotency_amqp::Topology;
use rand::Rng;
use serde_json::json;
use sqlx::{postgres::PgPoolOptions, Connection, Executor, PgConnection, PgPool};
use std::{
    collections::{BTreeMap, HashSet},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

/// The shop's queue (`shop::outbox::PURCHASES_QUEUE`).
const QUEUE: &str = "shop.purchases";

/// Settings of the `rabbitmq-cluster` topology.
#[derive(Debug, Clone, clap::Args)]
pub struct RabbitmqClusterArgs {
    /// rabbitmq-cluster: SIGKILLs of a node (each node back before the next kill).
    #[arg(
        long = "rabbitmq-cluster-kills",
        id = "rabbitmq_cluster_kills",
        default_value_t = 3
    )]
    pub kills: usize,
    /// rabbitmq-cluster: paid purchases (so events) at least.
    #[arg(
        long = "rabbitmq-cluster-events",
        id = "rabbitmq_cluster_events",
        default_value_t = 300
    )]
    pub events: usize,
    /// rabbitmq-cluster: the AMQP URLs of the three nodes, comma-separated, in node order.
    #[arg(
        long = "rabbitmq-cluster-urls",
        id = "rabbitmq_cluster_urls",
        default_value = "amqp://idem:idem@127.0.0.1:5681/idem,amqp://idem:idem@127.0.0.1:5682/idem,amqp://idem:idem@127.0.0.1:5683/idem"
    )]
    pub urls: String,
    /// rabbitmq-cluster: the topology's script (`kill N`, `start N`, `wait N`, `leader QUEUE`,
    /// `members QUEUE`, `clients`).
    #[arg(
        long = "rabbitmq-cluster-script",
        id = "rabbitmq_cluster_script",
        default_value = ".ci/topology/rabbitmq-cluster.sh"
    )]
    pub script: String,
    /// rabbitmq-cluster: declare classic queues instead of quorum queues (to see the checks
    /// fail: a classic queue lives on one node).
    #[arg(
        long = "rabbitmq-cluster-classic-queues",
        id = "rabbitmq_cluster_classic_queues",
        hide = true
    )]
    pub classic_queues: bool,
}

/// The topology's script, run with bash.
struct Script(Vec<String>);

impl Script {
    async fn run(&self, args: &[&str]) -> Result<String> {
        command::output(&self.0, args).await
    }

    /// A number per line of what `args` printed.
    async fn numbers(&self, args: &[&str]) -> Result<Vec<usize>> {
        let printed = self.run(args).await?;
        printed
            .lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| {
                line.trim()
                    .parse::<usize>()
                    .context(format!("{args:?} printed {line:?}"))
            })
            .collect()
    }

    /// Waits until node `restarted` (if any) sees the cluster whole again and `QUEUE` has its
    /// `nodes` members online.
    async fn whole(&self, restarted: Option<usize>, nodes: usize) -> Result<()> {
        if let Some(node) = restarted {
            self.run(&["wait", &node.to_string()]).await?;
        }
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let online = self.numbers(&["members", QUEUE]).await?;
            if online.first() == Some(&nodes) {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "{QUEUE} has {online:?} members online, not {nodes}, after 180 s"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// One SIGKILL of a node.
#[derive(Debug)]
struct Kill {
    node: usize,
    leader: bool,
    clients: usize,
}

/// Picks the node to kill: the queue's leader when a client is connected to it, otherwise the
/// node with the most client connections. Waits (a while) for a client to be connected.
async fn victim(script: &Script) -> Result<Kill> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let leader = script.numbers(&["leader", QUEUE]).await?.first().copied();
        let mut clients: BTreeMap<usize, usize> = BTreeMap::new();
        for node in script.numbers(&["clients"]).await? {
            *clients.entry(node).or_default() += 1;
        }
        let busiest = clients
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(node, _)| *node);
        let node = leader.filter(|l| clients.contains_key(l)).or(busiest);
        if let Some(node) = node {
            return Ok(Kill {
                node,
                leader: Some(node) == leader,
                clients: clients[&node],
            });
        }
        ensure!(
            Instant::now() < deadline,
            "no client connected to the cluster for 60 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Purchases of one tea (a new buyer every 100: no balance runs out), each driven to its end by the client
/// crate, by `clients` clients until `stop`, a short pause between two.
fn traffic(
    url: String,
    clients: usize,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<OpReport>>> {
    (0..clients)
        .map(|c| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let body = json!({"sku": "tea", "quantity": 1});
                let mut done = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let user = format!("reader-{c}-{}", done.len() / 100);
                    let key = uuid::Uuid::new_v4().to_string();
                    let limit = Duration::from_secs(60);
                    done.push(purchase_until_settled(&http, &url, &user, &key, &body, limit).await);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                done
            })
        })
        .collect()
}

/// The kills, while the traffic goes on: each waits for a whole cluster, kills, lets the
/// traffic run on the two nodes left, and starts the node again.
async fn kill_nodes(script: &Script, nodes: usize, kills: usize) -> Result<Vec<Kill>> {
    let mut done: Vec<Kill> = Vec::new();
    for _ in 0..kills {
        script.whole(done.last().map(|k| k.node), nodes).await?;
        let pause = rand::thread_rng().gen_range(1000..3000);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let kill = victim(script).await?;
        let node = kill.node.to_string();
        script.run(&["kill", &node]).await?;
        println!(
            "faults: rabbitmq-cluster: node {node} SIGKILLed ({}; {} client connection(s) on it)",
            if kill.leader {
                "the queue's leader"
            } else {
                "not the leader"
            },
            kill.clients
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
        script.run(&["start", &node]).await?;
        done.push(kill);
    }
    script.whole(done.last().map(|k| k.node), nodes).await?;
    Ok(done)
}

/// A fresh database `topo_rmq_…` on the shared PostgreSQL.
async fn fresh_database() -> Result<String> {
    test_support::fresh_postgres_url_with_prefix("topo_rmq")
        .await
        .context("TEST_POSTGRES_URL must name the PostgreSQL server (. .ci/databases.sh)")
}

/// Drops the run's database (after a successful run).
async fn drop_database(url: &str) -> Result<()> {
    let server = std::env::var("TEST_POSTGRES_URL")?;
    let name = url
        .split('?')
        .next()
        .and_then(|base| base.rsplit('/').next())
        .filter(|name| name.starts_with("topo_rmq_"))
        .context("not a topo_rmq_ database")?;
    let mut admin = PgConnection::connect(&server).await?;
    admin
        .execute(format!("DROP DATABASE {name} WITH (FORCE)").as_str())
        .await?;
    Ok(())
}

/// The first node of `urls` that answers.
async fn any_node(urls: &[String]) -> Result<&str> {
    let mut brokers = idempotency_amqp::Brokers::new(urls.iter().cloned());
    let (connection, node) = brokers
        .connect(lapin::ConnectionProperties::default())
        .await?;
    let _ = connection.close(200, "found".into()).await;
    Ok(&urls[node])
}

/// The shop and its worker on the cluster.
struct Processes {
    shop: ShopProcess,
    worker: WorkerProcess,
}

async fn start(env: &Env, args: &RabbitmqClusterArgs, database: &str) -> Result<Processes> {
    let urls: Vec<String> = args.urls.split(',').map(str::to_owned).collect();
    let quorum = (!args.classic_queues).then_some("--amqp-quorum-queues");
    let mut shop_args = env.shop_args();
    shop_args.extend(["--amqp-url".into(), urls.join(",")]);
    shop_args.extend(["--outbox-duplicate-share".into(), "0.05".into()]);
    shop_args.extend(quorum.map(str::to_owned));
    let shop_args = scenarios::as_strs(&shop_args);
    let shop = ShopProcess::start(&env.shop_bin, database, &shop_args).await?;
    let mut rotated = urls.clone();
    rotated.rotate_left(1);
    let mut worker_args = vec![
        "worker".to_owned(),
        "--database-url".into(),
        database.to_owned(),
        "--amqp-url".into(),
        rotated.join(","),
        "--lease-ms".into(),
        env.lease_ms.to_string(),
    ];
    worker_args.extend(quorum.map(str::to_owned));
    let worker = WorkerProcess::start(&env.shop_bin, worker_args).await?;
    Ok(Processes { shop, worker })
}

/// Waits until the relay and the worker drained everything: the outbox empty, the queue empty,
/// no worker key pending, a worker key for every purchase.
async fn drained(env: &Env, pool: &PgPool, urls: &[String]) -> Result<consumer_kill9::Tally> {
    let deadline = Instant::now() + env.settle_limit;
    loop {
        let t = consumer_kill9::tally(pool).await?;
        let keyed: i64 = t.keys.values().sum();
        let pending = t.keys.get("pending").copied().unwrap_or(0);
        let queued = consumer_kill9::ready(any_node(urls).await?, QUEUE).await?;
        if t.outbox == 0 && queued == 0 && pending == 0 && keyed >= t.purchases {
            return Ok(t);
        }
        if Instant::now() > deadline {
            bail!(
                "not drained within {:?}: outbox {}, queue {queued}, worker keys {:?}, purchases {}",
                env.settle_limit,
                t.outbox,
                t.keys,
                t.purchases
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Lines of `log` that contain `what`.
fn count_in_log(log: &std::path::Path, what: &str) -> usize {
    std::fs::read_to_string(log)
        .map(|text| text.lines().filter(|line| line.contains(what)).count())
        .unwrap_or(0)
}

/// What one run counted.
struct Counts {
    ops: Vec<OpReport>,
    purchases: PurchaseTally,
    events: consumer_kill9::Tally,
    dead_letters: u32,
    acknowledged_then_lost: usize,
    kills: Vec<Kill>,
    relay_connections: usize,
    worker_connections: usize,
}

impl Counts {
    fn print(&self) {
        let mut by_status = BTreeMap::new();
        for op in &self.ops {
            for (status, n) in &op.statuses {
                *by_status.entry(*status).or_default() += n;
            }
        }
        let t = &self.events;
        let completed = t.keys.get("completed").copied().unwrap_or(0);
        let leaders = self.kills.iter().filter(|k| k.leader).count();
        println!(
            "faults: rabbitmq-cluster: {} purchase operations, {} node kills ({leaders} of the queue's leader); answers: {}; relay connected {} times, worker {} times",
            self.ops.len(),
            self.kills.len(),
            scenarios::answers(&by_status),
            self.relay_connections,
            self.worker_connections
        );
        println!(
            "faults: rabbitmq-cluster: events {}, applied {} (worker keys completed {completed}), duplicates {}, lost {}, outbox left {}, dead letters {}; purchases: executed once {}, duplicated {}, acknowledged-then-lost {}, keys pending {} (worker keys {:?})",
            t.purchases,
            t.grants,
            self.duplicates(),
            self.lost(),
            t.outbox,
            self.dead_letters,
            self.purchases.executed_once,
            self.purchases.duplicated,
            self.acknowledged_then_lost,
            self.purchases.pending,
            t.keys
        );
    }

    /// Events applied more than once: receipts sent twice, grants beyond one per purchase.
    fn duplicates(&self) -> i64 {
        self.events.mails_doubled
            + self.events.grants_off
            + (self.events.grants - self.events.purchases).max(0)
    }

    /// Events never applied: purchases without their grant or without a completed worker key.
    fn lost(&self) -> i64 {
        let t = &self.events;
        let completed = t.keys.get("completed").copied().unwrap_or(0);
        (t.purchases - t.grants).max(0) + (t.purchases - completed).max(0)
    }

    fn problems(&self, planned: &RabbitmqClusterArgs) -> Vec<String> {
        let t = &self.events;
        let mut problems = Vec::new();
        let completed = t.keys.get("completed").copied().unwrap_or(0);
        let keyed: i64 = t.keys.values().sum();
        if t.purchases < planned.events as i64 {
            problems.push(format!(
                "only {} events, {} planned",
                t.purchases, planned.events
            ));
        }
        if self.kills.len() < planned.kills {
            problems.push(format!("only {} kills", self.kills.len()));
        }
        if self.duplicates() != 0 || t.grants != t.purchases {
            problems.push(format!(
                "{} grants for {} purchases ({} wrong), {} receipts sent twice",
                t.grants, t.purchases, t.grants_off, t.mails_doubled
            ));
        }
        if self.lost() != 0 || completed != keyed || t.receipts != completed {
            problems.push(format!(
                "worker keys {:?} and {} receipts for {} purchases",
                t.keys, t.receipts, t.purchases
            ));
        }
        if t.outbox != 0 || self.dead_letters != 0 || t.receipts_without_mail != 0 {
            problems.push(format!(
                "outbox left {}, dead letters {}, receipts without a mail {}",
                t.outbox, self.dead_letters, t.receipts_without_mail
            ));
        }
        if self.acknowledged_then_lost != 0 || self.purchases.duplicated != 0 {
            problems.push(format!(
                "{} purchases answered 201 and lost, {} purchase violations",
                self.acknowledged_then_lost, self.purchases.duplicated
            ));
        }
        let reconnections = (self.relay_connections + self.worker_connections).saturating_sub(2);
        if reconnections < self.kills.len() {
            problems.push(format!(
                "the relay and the worker reconnected {reconnections} times for {} kills: the kills missed the clients",
                self.kills.len()
            ));
        }
        problems
    }
}

/// Runs the `rabbitmq-cluster` scenario.
pub async fn run(env: &Env, args: &RabbitmqClusterArgs) -> Result<()> {
    let script = Script(vec!["bash".into(), args.script.clone()]);
    let urls: Vec<String> = args.urls.split(',').map(str::to_owned).collect();
    script
        .run(&["wait", "1"])
        .await
        .context("the cluster is not up: run `bash .ci/topology/rabbitmq-cluster.sh up` first")?;
    let topology = if args.classic_queues {
        Topology::new(QUEUE)
    } else {
        Topology::new(QUEUE).quorum()
    };
    consumer_kill9::purge(any_node(&urls).await?, &topology)
        .await
        .context("preparing the queues")?;
    let database = fresh_database().await?;
    let counts = match flow(env, args, &script, &urls, &database).await {
        Ok(counts) => counts,
        Err(error) => return Err(error.context(format!("database {database} kept"))),
    };
    counts.print();
    let problems = counts.problems(args);
    if !problems.is_empty() {
        bail!("{} (database {database} kept)", problems.join("; "));
    }
    drop_database(&database).await
}

/// The traffic, the kills, the drain and the counts.
async fn flow(
    env: &Env,
    args: &RabbitmqClusterArgs,
    script: &Script,
    urls: &[String],
    database: &str,
) -> Result<Counts> {
    let Processes {
        mut shop,
        mut worker,
    } = start(env, args, database).await?;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(database)
        .await?;
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = traffic(shop.url(), 4, stop.clone());
    let started = Instant::now();
    let kills = kill_nodes(script, urls.len(), args.kills).await?;
    // Enough events, whatever the kills took.
    loop {
        let t = consumer_kill9::tally(&pool).await?;
        if t.purchases >= args.events as i64 {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(300),
            "only {} paid purchases after 300 s",
            t.purchases
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let ops = scenarios::collect(traffic).await?;
    if let Some(status) = worker.exited()? {
        bail!("the worker exited ({status}); log {}", worker.log.display());
    }
    let purchases = scenarios::settle_and_check(env, database, &ops).await?;
    let events = drained(env, &pool, urls).await?;
    let dead_letters = consumer_kill9::ready(
        any_node(urls).await?,
        Topology::new(QUEUE).dead_letter_queue(),
    )
    .await?;
    let acknowledged_then_lost = acknowledged_then_lost(&pool, &ops).await?;
    worker.kill9().await?;
    shop.kill9().await?;
    pool.close().await;
    ensure!(
        !worker.panicked() && !shop.panicked(),
        "a process panicked; logs {} and {}",
        worker.log.display(),
        shop.log().display()
    );
    Ok(Counts {
        ops,
        purchases,
        events,
        dead_letters,
        acknowledged_then_lost,
        kills,
        relay_connections: count_in_log(shop.log(), "outbox relay connected"),
        worker_connections: count_in_log(&worker.log, "worker connected"),
    })
}

/// Purchases answered 201 whose purchase is not in the database.
async fn acknowledged_then_lost(pool: &PgPool, ops: &[OpReport]) -> Result<usize> {
    let stored: HashSet<String> = sqlx::query_scalar::<_, i64>("SELECT id FROM shop_purchases")
        .fetch_all(pool)
        .await?
        .into_iter()
        .map(|id| id.to_string())
        .collect();
    Ok(ops
        .iter()
        .filter(|op| op.settled == Settled::Created)
        .filter(|op| {
            !op.purchase_ids.iter().all(|id| stored.contains(id)) || op.purchase_ids.is_empty()
        })
        .count())
}
