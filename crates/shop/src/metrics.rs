//! Prometheus metrics: the `idempotency-http` middleware's outcome counters
//! (`idempotency_requests_total{operation, outcome}`, see [`idempotency_http::metrics`]),
//! rendered by `GET /metrics`.

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

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
            metrics::describe_counter!(
                idempotency_http::metrics::REQUESTS_TOTAL,
                "Requests through the idempotency middleware, by operation and outcome"
            );
            handle
        })
        .clone()
}
