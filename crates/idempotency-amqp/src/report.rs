//! What a consumer did, and why it stopped.

use std::fmt;

/// How one delivery was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    Executed,
    Replayed,
    RetriedLater,
    Retried,
    DeadLettered,
    RequeuedUnstarted,
    /// The ack or nack could not be sent (the channel is gone): the broker requeues the delivery.
    Unsettled,
}

/// Deliveries by how they were settled, over a consumer's run.
///
/// ```
/// use idempotency_amqp::ConsumerReport;
/// let report = ConsumerReport::default();
/// assert_eq!(report.total(), 0);
/// assert_eq!(report.to_string(), "executed 0, replayed 0, retried later 0, retried 0, dead-lettered 0, requeued at shutdown 0, unsettled 0");
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerReport {
    /// Acked after their work ran and committed.
    pub executed: u64,
    /// Acked as replays: an earlier delivery had applied the message.
    pub replayed: u64,
    /// Requeued because another delivery of the same message was in progress.
    pub retried_later: u64,
    /// Requeued after a failure (the key released).
    pub retried: u64,
    /// Dead-lettered (payload mismatch, poison, definitive failure, review, invalid).
    pub dead_lettered: u64,
    /// Received but not started when the shutdown began, and requeued.
    pub requeued_at_shutdown: u64,
    /// Whose ack or nack could not be sent (the channel failed): the broker requeues them.
    pub unsettled: u64,
}

impl ConsumerReport {
    /// All deliveries counted.
    pub fn total(&self) -> u64 {
        self.executed
            + self.replayed
            + self.retried_later
            + self.retried
            + self.dead_lettered
            + self.requeued_at_shutdown
            + self.unsettled
    }

    pub(crate) fn add(&mut self, settled: Settled) {
        let counter = match settled {
            Settled::Executed => &mut self.executed,
            Settled::Replayed => &mut self.replayed,
            Settled::RetriedLater => &mut self.retried_later,
            Settled::Retried => &mut self.retried,
            Settled::DeadLettered => &mut self.dead_lettered,
            Settled::RequeuedUnstarted => &mut self.requeued_at_shutdown,
            Settled::Unsettled => &mut self.unsettled,
        };
        *counter += 1;
    }
}

impl fmt::Display for ConsumerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "executed {}, replayed {}, retried later {}, retried {}, dead-lettered {}, requeued at shutdown {}, unsettled {}",
            self.executed,
            self.replayed,
            self.retried_later,
            self.retried,
            self.dead_lettered,
            self.requeued_at_shutdown,
            self.unsettled
        )
    }
}

/// Why a consumer stopped before it was asked to, with what it did until then.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The channel or the connection failed (or could not start consuming).
    #[error("the AMQP channel failed: {source}")]
    Amqp {
        /// The error.
        #[source]
        source: lapin::Error,
        /// The deliveries settled before.
        report: ConsumerReport,
    },
    /// The broker cancelled the consumer (its queue was deleted, or the node went down).
    #[error("the broker cancelled the consumer")]
    Cancelled {
        /// The deliveries settled before.
        report: ConsumerReport,
    },
}

impl ConsumerError {
    /// The deliveries settled before the consumer stopped.
    pub fn report(&self) -> &ConsumerReport {
        match self {
            ConsumerError::Amqp { report, .. } | ConsumerError::Cancelled { report } => report,
        }
    }

    pub(crate) fn with_report(mut self, settled: ConsumerReport) -> Self {
        match &mut self {
            ConsumerError::Amqp { report, .. } | ConsumerError::Cancelled { report } => {
                *report = settled
            }
        }
        self
    }
}
