//! The published conformance suite (`idempotency::store::testing`, `store_conformance!`) on this
//! crate's three stores: each runs the suite of every capability it implements.

mod common;

use common::Harness;
use idempotency::{MySqlStore, PgStore, SqliteStore};

mod sqlite {
    use super::*;

    async fn fresh() -> Option<SqliteStore> {
        <SqliteStore as Harness>::open().await
    }

    // SQLite has no `ReserveInTransaction`: its one writer queues whole transactions.
    idempotency::store::testing::store_conformance!(
        fresh,
        [protocol, journal, completion_signal, maintenance],
        single_writer
    );
}

mod postgres {
    use super::*;

    async fn fresh() -> Option<PgStore> {
        <PgStore as Harness>::open().await
    }

    idempotency::store::testing::store_conformance!(
        fresh,
        [
            protocol,
            journal,
            reserve_in_transaction,
            completion_signal,
            maintenance
        ]
    );
}

mod mysql {
    use super::*;

    async fn fresh() -> Option<MySqlStore> {
        <MySqlStore as Harness>::open().await
    }

    idempotency::store::testing::store_conformance!(
        fresh,
        [
            protocol,
            journal,
            reserve_in_transaction,
            completion_signal,
            maintenance
        ]
    );
}
