//! `consumer-kill9`: the purchase events of the shop's transactional outbox, consumed by
//! `shop worker` on a real RabbitMQ while the worker is SIGKILLed at random moments (and, in the
//! broker-restart variant, RabbitMQ's application is stopped and started mid-flow).
//!
//! The shop publishes a share of its outbox rows twice on purpose. At the end, from the
//! database and the broker:
//! * every paid purchase's event took effect exactly once: one grant of points per purchase,
//!   and one e-mail at most at the mail provider, which has no idempotency keys (the grants'
//!   unique constraint could hide a doubled consumer; the e-mails cannot);
//! * nothing was lost: the outbox is empty, the queue drained, every purchase has its key;
//! * no key is left pending;
//! * every dead letter (a receipt of unknown outcome, parked for review) carries its reason,
//!   and names a key parked as `needs_review`.

use crate::{
    client::purchase_until_settled,
    scenarios::Env,
    shop_process::{spawn_logged, ShopProcess},
};
use anyhow::{bail, ensure, Context, Result};
use idempotency_amqp::{headers, Topology};
use lapin::{
    options::{BasicGetOptions, QueueDeclareOptions, QueuePurgeOptions},
    types::{AMQPValue, FieldTable},
    Connection, ConnectionProperties,
};
use rand::Rng;
use serde_json::json;
use sqlx::{postgres::PgPoolOptions, PgPool};
use std::{
    collections::{BTreeMap, HashSet},
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};
use tokio::process::Child;

/// The shop's queue (`shop::outbox::PURCHASES_QUEUE`).
const QUEUE: &str = "shop.purchases";

/// How the scenario is sized and which faults it injects.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Paid purchases (so events) at least.
    pub messages: usize,
    /// SIGKILLs of the worker at least.
    pub kills: usize,
    /// Stop and start RabbitMQ's application mid-flow.
    pub broker_restart: bool,
}

/// A `shop worker` process that can be SIGKILLed and started again.
pub(crate) struct WorkerProcess {
    bin: std::path::PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    pub(crate) log: std::path::PathBuf,
    pub(crate) starts: usize,
}

impl WorkerProcess {
    pub(crate) async fn start(bin: &Path, args: Vec<String>) -> Result<Self> {
        let log = std::env::temp_dir().join(format!("faults-worker-{}.log", std::process::id()));
        let mut worker = Self {
            bin: bin.to_path_buf(),
            args,
            child: None,
            log,
            starts: 0,
        };
        worker.spawn()?;
        Ok(worker)
    }

    pub(crate) fn spawn(&mut self) -> Result<()> {
        self.child = Some(spawn_logged(&self.bin, &self.args, &self.log)?);
        self.starts += 1;
        Ok(())
    }

    pub(crate) async fn kill9(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.start_kill()?;
            child.wait().await?;
        }
        Ok(())
    }

    pub(crate) fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => Ok(child.try_wait()?),
            None => Ok(None),
        }
    }

    pub(crate) fn panicked(&self) -> bool {
        std::fs::read_to_string(&self.log).is_ok_and(|log| log.contains("panicked"))
    }
}

/// Runs `ctl … verb` (the RabbitMQ control command).
async fn rabbitmq(ctl: &[String], verb: &str) -> Result<()> {
    crate::command::run(ctl, &[verb]).await?;
    Ok(())
}

/// Declares `topology` and empties its queue and dead-letter queue (left by an earlier run).
pub(crate) async fn purge(amqp_url: &str, topology: &Topology) -> Result<()> {
    let connection = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    topology.declare(&channel).await?;
    for queue in [topology.queue(), topology.dead_letter_queue()] {
        channel
            .queue_purge(queue.into(), QueuePurgeOptions::default())
            .await?;
    }
    connection.close(200, "purged".into()).await?;
    Ok(())
}

/// Messages ready in `queue` (unacked ones are not counted by the broker's answer).
pub(crate) async fn ready(amqp_url: &str, queue: &str) -> Result<u32> {
    let connection = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let _ = connection.close(200, "counted".into()).await;
    Ok(declared.message_count())
}

/// The dead letters: (message id, reason), taken off the dead-letter queue.
async fn dead_letters(amqp_url: &str) -> Result<Vec<(String, Option<String>)>> {
    let connection = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let queue = Topology::new(QUEUE).dead_letter_queue().to_owned();
    let mut letters = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await?
    {
        let properties = &message.delivery.properties;
        let id = properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default();
        let reason = properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(headers::REASON))
            .and_then(|value| match value {
                AMQPValue::LongString(s) => Some(s.to_string()),
                AMQPValue::ShortString(s) => Some(s.to_string()),
                _ => None,
            })
            .filter(|reason| !reason.trim().is_empty());
        letters.push((id, reason));
    }
    let _ = connection.close(200, "read".into()).await;
    Ok(letters)
}

/// What the database says once the flow settled.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) purchases: i64,
    pub(crate) outbox: i64,
    pub(crate) grants: i64,
    pub(crate) grants_off: i64,
    pub(crate) keys: BTreeMap<String, i64>,
    pub(crate) mails_doubled: i64,
    pub(crate) receipts: i64,
    pub(crate) receipts_without_mail: i64,
    pub(crate) parked: HashSet<String>,
}

pub(crate) async fn tally(pool: &PgPool) -> Result<Tally> {
    let scalar = |sql: &'static str| async move {
        sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(pool)
            .await
            .with_context(|| sql.to_owned())
    };
    let keys: Vec<(String, i64)> = sqlx::query_as(
        "SELECT state, count(*) FROM idempotency_keys WHERE scope = 'shop.worker' GROUP BY state",
    )
    .fetch_all(pool)
    .await?;
    let parked: Vec<String> = sqlx::query_scalar(
        "SELECT idem_key FROM idempotency_keys WHERE scope = 'shop.worker' AND state = 'needs_review'",
    )
    .fetch_all(pool)
    .await?;
    Ok(Tally {
        purchases: scalar("SELECT count(*) FROM shop_purchases").await?,
        outbox: scalar("SELECT count(*) FROM shop_outbox").await?,
        grants: scalar("SELECT count(*) FROM shop_point_grants").await?,
        // A grant for an order without a purchase, or of the wrong number of points.
        grants_off: scalar(
            "SELECT count(*) FROM shop_point_grants g
               LEFT JOIN shop_purchases p ON p.order_id = g.order_id
               LEFT JOIN shop_orders o ON o.id = g.order_id
              WHERE p.id IS NULL OR g.points <> (o.amount_cents + 99) / 100",
        )
        .await?,
        keys: keys.into_iter().collect(),
        mails_doubled: scalar(
            "SELECT count(*) FROM (SELECT client_ref FROM mail_provider_messages
              GROUP BY client_ref HAVING count(*) > 1) doubled",
        )
        .await?,
        receipts: scalar("SELECT count(*) FROM shop_emails").await?,
        receipts_without_mail: scalar(
            "SELECT count(*) FROM shop_emails e
              WHERE NOT EXISTS (SELECT 1 FROM mail_provider_messages m WHERE m.message_id = e.message_id)",
        )
        .await?,
        parked: parked.into_iter().collect(),
    })
}

/// The scenario; `rabbitmq_ctl` controls the broker for the restart variant.
pub async fn consumer_kill9(env: &Env, plan: Plan, rabbitmq_ctl: &[String]) -> Result<()> {
    let name = if plan.broker_restart {
        "consumer-kill9/broker-restart"
    } else {
        "consumer-kill9"
    };
    let amqp_url = std::env::var("TEST_AMQP_URL")
        .context("TEST_AMQP_URL must name the RabbitMQ broker (. .ci/rabbitmq.sh)")?;
    purge(&amqp_url, &Topology::new(QUEUE))
        .await
        .context("preparing the queues")?;
    let database = test_support::fresh_postgres_url()
        .await
        .context("TEST_POSTGRES_URL must name the PostgreSQL server")?;
    let mut shop_args = env.shop_args();
    shop_args.extend([
        "--amqp-url".into(),
        amqp_url.clone(),
        "--outbox-duplicate-share".into(),
        "0.1".into(),
    ]);
    let shop_args: Vec<&str> = shop_args.iter().map(String::as_str).collect();
    let mut shop = ShopProcess::start(&env.shop_bin, &database, &shop_args).await?;
    let worker_args = vec![
        "worker".to_owned(),
        "--database-url".into(),
        database.clone(),
        "--amqp-url".into(),
        amqp_url.clone(),
        "--mail-fail-rate".into(),
        "0.02".into(),
        "--lease-ms".into(),
        env.lease_ms.to_string(),
    ];
    let mut worker = WorkerProcess::start(&env.shop_bin, worker_args).await?;

    // Traffic: purchases driven to completion by the client crate, 16 at a time.
    let paid = Arc::new(AtomicUsize::new(0));
    let clients = 16;
    let per_client = plan.messages.div_ceil(clients);
    let traffic: Vec<_> = (0..clients)
        .map(|c| {
            let (url, paid) = (shop.url(), paid.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let mut gave_up = Vec::new();
                for n in 0..per_client {
                    let user = format!("reader-{}", (c + n) % 24);
                    let key = uuid::Uuid::new_v4().to_string();
                    let body = json!({"sku": "tea", "quantity": 1});
                    let op = purchase_until_settled(
                        &http,
                        &url,
                        &user,
                        &key,
                        &body,
                        Duration::from_secs(60),
                    )
                    .await;
                    match op.settled {
                        crate::client::Settled::Created => {
                            paid.fetch_add(1, Ordering::Relaxed);
                        }
                        other => gave_up.push(format!("{user} {key}: {other:?}")),
                    }
                }
                gave_up
            })
        })
        .collect();

    // Faults: SIGKILL the worker at random moments; once, stop and start the broker.
    let traffic_done = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut kills = 0;
    let mut restarted_broker = !plan.broker_restart;
    while kills < plan.kills || !traffic_done.load(Ordering::Relaxed) {
        let pause = rand::thread_rng().gen_range(150..700);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        if traffic.iter().all(|t| t.is_finished()) {
            traffic_done.store(true, Ordering::Relaxed);
        }
        if let Some(status) = worker.exited()? {
            bail!(
                "{name}: the worker exited on its own ({status}); log {}",
                worker.log.display()
            );
        }
        let paid_so_far = paid.load(Ordering::Relaxed);
        if !restarted_broker && paid_so_far >= plan.messages * 2 / 5 {
            rabbitmq(rabbitmq_ctl, "stop_app").await?;
            tokio::time::sleep(Duration::from_secs(2)).await;
            rabbitmq(rabbitmq_ctl, "start_app").await?;
            restarted_broker = true;
            println!(
                "faults: {name}: RabbitMQ stopped after {paid_so_far} paid purchases, started again 2 s later ({} paid by then)",
                paid.load(Ordering::Relaxed)
            );
        }
        if kills < plan.kills || !traffic_done.load(Ordering::Relaxed) {
            worker.kill9().await?;
            kills += 1;
            worker.spawn()?;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(300),
            "{name}: the traffic did not end within 300 s"
        );
    }
    let mut gave_up = Vec::new();
    for t in traffic {
        gave_up.extend(t.await?);
    }
    ensure!(
        gave_up.is_empty(),
        "{name}: purchases not driven to completion: {gave_up:?}"
    );
    let flow_took = started.elapsed();

    // Let the relay and the worker finish, then check.
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&database)
        .await?;
    let deadline = Instant::now() + env.settle_limit;
    let settled = loop {
        let t = tally(&pool).await?;
        let keyed: i64 = t.keys.values().sum();
        let pending = t.keys.get("pending").copied().unwrap_or(0);
        let queued = ready(&amqp_url, QUEUE).await?;
        if t.outbox == 0 && queued == 0 && pending == 0 && keyed >= t.purchases {
            break t;
        }
        if Instant::now() > deadline {
            bail!(
                "{name}: not settled within {:?}: outbox {}, queue {queued}, keys {:?}, purchases {}",
                env.settle_limit,
                t.outbox,
                t.keys,
                t.purchases
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // A key is parked before its message is dead-lettered and acknowledged: the last letters
    // may still be on their way once the database has settled. Collect them until every parked
    // key has its letter, or the settle limit ends (the check below then names the missing one).
    let mut letters = Vec::new();
    loop {
        letters.extend(dead_letters(&amqp_url).await?);
        let lettered: HashSet<&String> = letters.iter().map(|(id, _)| id).collect();
        if settled.parked.iter().all(|id| lettered.contains(id)) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    worker.kill9().await?;
    shop.kill9().await?;
    pool.close().await;

    let t = settled;
    let completed = t.keys.get("completed").copied().unwrap_or(0);
    let parked = t.parked.len() as i64;
    println!(
        "faults: {name}: {} paid purchases in {:.1}s, worker SIGKILLed {kills} times ({} starts); keys completed {completed}, needs_review {parked}, other {:?}; grants {}, receipts {}, dead letters {}",
        t.purchases,
        flow_took.as_secs_f64(),
        worker.starts,
        t.keys,
        t.grants,
        t.receipts,
        letters.len()
    );
    let mut problems = Vec::new();
    if t.purchases < plan.messages as i64 {
        problems.push(format!(
            "only {} paid purchases, {} planned",
            t.purchases, plan.messages
        ));
    }
    if kills < plan.kills {
        problems.push(format!("only {kills} kills"));
    }
    if t.grants != t.purchases || t.grants_off != 0 {
        problems.push(format!(
            "{} grants for {} purchases ({} wrong)",
            t.grants, t.purchases, t.grants_off
        ));
    }
    if completed + parked != t.purchases || completed + parked != t.keys.values().sum::<i64>() {
        problems.push(format!("keys {:?} for {} purchases", t.keys, t.purchases));
    }
    if t.mails_doubled != 0 {
        problems.push(format!("{} receipts sent twice", t.mails_doubled));
    }
    if t.receipts != completed || t.receipts_without_mail != 0 {
        problems.push(format!(
            "{} receipts recorded for {completed} completed events ({} without a sent mail)",
            t.receipts, t.receipts_without_mail
        ));
    }
    for (id, reason) in &letters {
        if reason.is_none() {
            problems.push(format!("dead letter {id} without a reason"));
        }
        if !t.parked.contains(id) {
            problems.push(format!("dead letter {id} names no parked key"));
        }
    }
    let lettered: HashSet<&String> = letters.iter().map(|(id, _)| id).collect();
    if let Some(silent) = t.parked.iter().find(|id| !lettered.contains(id)) {
        problems.push(format!("parked key {silent} was never dead-lettered"));
    }
    if worker.panicked() || shop.panicked() {
        problems.push("a process panicked".into());
    }
    ensure!(problems.is_empty(), "{name}: {}", problems.join("; "));
    Ok(())
}
