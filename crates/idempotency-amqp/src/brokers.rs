//! The nodes of a RabbitMQ cluster, connected to in turn: lapin connects to one URL, so a client
//! that reconnects after its node died must pick another node itself.

use lapin::{Connection, ConnectionProperties};
use std::time::Duration;

/// The AMQP URLs of a cluster's nodes (or the one URL of a single broker), tried in turn.
///
/// [`connect`](Self::connect) starts with the node *after* the one it connected to last, then
/// tries the others in order, and returns the first connection that opens: a client that
/// reconnects in a loop after its connection failed moves to the next node, and comes back
/// round to a node that was down once the others are. Each attempt is bounded by
/// [`with_connect_timeout`](Self::with_connect_timeout) (10 s by default), so an unreachable
/// host costs no more than that.
///
/// The cluster's queues must be **quorum queues** ([`Topology::quorum`](crate::Topology::quorum)):
/// a classic queue lives on one node, and is unusable while that node is down.
///
/// ```
/// use idempotency_amqp::Brokers;
/// let cluster = Brokers::parse("amqp://idem:idem@10.0.0.1:5672/idem, amqp://idem:idem@10.0.0.2:5672/idem");
/// assert_eq!(cluster.urls().len(), 2);
/// ```
#[derive(Debug, Clone)]
pub struct Brokers {
    urls: Vec<String>,
    next: usize,
    connect_timeout: Duration,
}

impl Brokers {
    /// These URLs, tried in this order first.
    pub fn new<I, U>(urls: I) -> Self
    where
        I: IntoIterator<Item = U>,
        U: Into<String>,
    {
        Self {
            urls: urls.into_iter().map(Into::into).collect(),
            next: 0,
            connect_timeout: Duration::from_secs(10),
        }
    }

    /// A comma-separated list of URLs (spaces around the commas are ignored; a comma inside a
    /// URL must be percent-encoded as `%2C`).
    pub fn parse(list: &str) -> Self {
        Self::new(list.split(',').map(str::trim).filter(|url| !url.is_empty()))
    }

    /// How long one connection attempt may take before the next node is tried.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The URLs, in the order given.
    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// Connects to the first node that accepts, starting after the one connected to last.
    /// Returns the connection and the index of its URL in [`urls`](Self::urls); fails with the
    /// last node's error when none accepts (or when the list is empty).
    pub async fn connect(
        &mut self,
        properties: ConnectionProperties,
    ) -> Result<(Connection, usize), lapin::Error> {
        let mut last = std::io::Error::new(std::io::ErrorKind::InvalidInput, "no AMQP URL").into();
        for attempt in 0..self.urls.len() {
            let index = (self.next + attempt) % self.urls.len();
            let connecting = Connection::connect(&self.urls[index], properties.clone());
            match tokio::time::timeout(self.connect_timeout, connecting).await {
                Ok(Ok(connection)) => {
                    self.next = index + 1;
                    return Ok((connection, index));
                }
                Ok(Err(error)) => last = error,
                Err(_) => last = std::io::Error::from(std::io::ErrorKind::TimedOut).into(),
            }
        }
        Err(last)
    }
}
