//! The example store (`examples/memory_store.rs`, an in-memory illustration) through the
//! published conformance suite: the ten lines a store written outside this crate needs.

#[allow(dead_code)]
#[path = "../examples/memory_store.rs"]
mod memory_store;

use idempotency::Store;
use memory_store::MemoryStore;

async fn fresh() -> Option<MemoryStore> {
    let store = MemoryStore::new().await.expect("an in-memory database");
    store.migrate().await.expect("migrate");
    Some(store)
}

// One connection: an open business transaction holds every other statement back.
idempotency::store_conformance!(fresh, [protocol, journal, completion_signal], single_writer);
