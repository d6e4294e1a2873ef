//! The spans of `idempotency` exported to OpenTelemetry: a `tracing-opentelemetry` layer on the
//! subscriber, an SDK tracer provider with the stdout exporter, and one request (then its replay)
//! through [`Idempotency`] on SQLite in memory. Each span (`idempotency.reserve`,
//! `idempotency.work`, `idempotency.complete`, `idempotency.replay` …) is printed as an
//! OpenTelemetry span, a child of the request's span. In a service, swap the stdout exporter for
//! an OTLP one (crate `opentelemetry-otlp`) that sends to a collector.
//!
//! Run: `cargo run -p otel-example`.

use idempotency::{Attempt, Fingerprint, Idempotency, IdempotencyKey, SqliteStore, Store};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::{trace::SdkTracerProvider, Resource};
use tracing::Instrument;
use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt, EnvFilter};

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let provider = SdkTracerProvider::builder()
        .with_resource(
            Resource::builder()
                .with_service_name("otel-example")
                .build(),
        )
        .with_simple_exporter(opentelemetry_stdout::SpanExporter::default())
        .build();
    let tracer = provider.tracer("otel-example");
    // The engine's spans are at `debug`: enable them for the `idempotency` target.
    tracing_subscriber::registry()
        .with(EnvFilter::new("info,idempotency=debug"))
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .init();

    // One connection: every connection to `sqlite::memory:` is a database of its own.
    let pool = SqliteStore::pool_options()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await?;
    let store = SqliteStore::new(pool);
    store.migrate().await?;
    let idem = Idempotency::new(store);

    let attempt = Attempt::new(
        IdempotencyKey::new("user-42", "purchase", "k-1")?,
        Fingerprint::of_bytes(b"tea x2"),
    );
    for request in ["first request", "retry"] {
        let outcome = idem
            .run(&attempt, async |_tx| {
                Ok::<_, sqlx::Error>("order 1".to_owned())
            })
            .instrument(tracing::info_span!("request", name = request))
            .await?;
        eprintln!("{request}: replayed = {}", outcome.is_replayed());
    }

    provider.shutdown()?;
    Ok(())
}
