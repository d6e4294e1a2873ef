//! Prometheus metrics: the guard's outcome counters, rendered by `GET /metrics`.

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

/// Counter of guard outcomes, labelled by `operation` and `outcome` (`executed`, `replayed`,
/// `in_progress`, `key_reused`, `needs_review`, `released`, `parked`, `lease_lost`,
/// `rejected`, `unavailable`).
pub const OUTCOMES: &str = "shop_idempotency_outcomes_total";

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder once and returns its handle.
pub fn handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (a host process); then ours only renders
            // what it recorded, which is nothing: acceptable for a demo.
            let _ = metrics::set_global_recorder(recorder);
            metrics::describe_counter!(OUTCOMES, "Idempotency guard outcomes by operation");
            handle
        })
        .clone()
}

/// Counts one guard outcome.
pub fn outcome(operation: &'static str, outcome: &'static str) {
    metrics::counter!(OUTCOMES, "operation" => operation, "outcome" => outcome).increment(1);
}
