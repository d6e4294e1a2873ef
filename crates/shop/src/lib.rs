//! The demo shop: every defence of the idempotency article working together.
//!
//! * **Idempotency-Key** on `POST /purchases`, `POST /orders` and `POST /emails`, reserved
//!   first (its own commit), completed in the business transaction, by the `idempotency-http`
//!   middleware ([`protect`], [`tx`]);
//! * a **payment provider that honours idempotency keys**, to which our key is passed on, and a
//!   **mail provider that does not**, whose unknown outcomes park the key ([`providers`]);
//! * a **guarded state transition** (`POST /orders/{id}/pay`) and a **business unique
//!   constraint** (`POST /points/grants`) ([`routes`]);
//! * the **storm** that hammers it all with duplicates and checks the ledgers ([`storm`]), and
//!   the **benchmark** ([`bench`]);
//! * a **transactional outbox** of purchase events relayed to RabbitMQ ([`outbox`]), and
//!   `shop worker`, their idempotent consumer ([`worker`]) of a durable operation ([`events`]).
#![warn(missing_docs)]

pub mod app;
pub mod auth;
pub mod bench;
pub mod client;
mod cpu;
pub mod db;
pub mod events;
pub mod heap;
pub mod metrics;
pub mod outbox;
pub mod problem;
pub mod protect;
pub mod providers;
pub mod purchase;
pub mod router;
pub mod routes;
pub mod scale;
pub mod state;
pub mod storm;
pub mod tx;
pub mod worker;
