//! The example store (`examples/minimal_store.rs`, an illustration) through the
//! published conformance suite: the ten lines a store written outside this crate needs.

#[allow(dead_code)]
#[path = "../examples/minimal_store.rs"]
mod minimal_store;

use idempotency::Store;
use minimal_store::MinimalStore;

async fn fresh() -> Option<MinimalStore> {
    let store = MinimalStore::new().await.expect("an in-memory database");
    store.migrate().await.expect("migrate");
    Some(store)
}

// One writer connection: an open business transaction holds every other write back.
idempotency::store::testing::store_conformance!(
    fresh,
    [protocol, journal, completion_signal, maintenance],
    single_writer
);
