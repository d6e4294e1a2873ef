//! Serving: [`start`] connects, binds and runs the service in a background task.

use crate::{
    router::router,
    state::{App, Config},
};
use idempotency::maintenance::WorkerHandle;
use std::net::SocketAddr;

/// A running service (in this process).
#[derive(Debug)]
pub struct Running {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The state (for direct database checks).
    pub app: App,
    task: tokio::task::JoinHandle<()>,
    worker: Option<WorkerHandle>,
    relay: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// The base URL, `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops the maintenance worker after its pass under way (a no-op without one).
    pub async fn stop_worker(&mut self) {
        if let Some(worker) = self.worker.take() {
            let report = worker.shutdown().await;
            tracing::debug!(%report, "maintenance worker stopped");
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(relay) = &self.relay {
            relay.abort();
        }
    }
}

/// Connects, migrates, binds `listen` (port 0 picks a free port) and serves in a background task.
pub async fn start(config: &Config, listen: &str) -> anyhow::Result<Running> {
    crate::metrics::handle();
    let app = App::connect(config).await?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let router = router(app.clone(), config);
    let task = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, router).await {
            tracing::error!(%error, "server stopped");
        }
    });
    let worker = config
        .worker_interval
        .map(|interval| app.spawn_worker(interval));
    let relay = config.amqp_url.as_ref().map(|url| {
        let relay = crate::outbox::Relay::new(app.db().clone(), url)
            .with_quorum_queues(config.amqp_quorum_queues)
            .with_duplicate_share(config.outbox_duplicate_share);
        tokio::spawn(relay.run())
    });
    Ok(Running {
        addr,
        app,
        task,
        worker,
        relay,
    })
}
