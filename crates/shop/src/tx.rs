//! [`BusinessTx`]: the business transaction of a request, whoever opened it.
//!
//! On a keyed route the `idempotency-http` layer opens it ([`IdempotentTx`]): the handler's rows
//! and the stored response commit together. On the other routes (a guarded transition, a
//! unique-constraint insert, the benchmark's unprotected twin) [`plain_tx`] opens a plain
//! transaction and commits it after a 2xx. The handlers are written once, against either
//! backend, through [`BusinessTx::conn`].

use crate::{
    db::{Conn, Kind, Tx},
    problem::{Problem, ShopProblem},
    state::App,
};
use axum::{
    extract::{FromRequestParts, Request, State},
    http::{request::Parts, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
};
use idempotency::{MySqlStore, PgStore, SqliteStore};
use idempotency_http::{Disposition, IdempotentTx, KeyLease};
use sqlx::{MySql, Postgres, Sqlite};
use std::sync::{Arc, Mutex};

/// The transaction of a request, as an extractor: run statements on [`conn`](Self::conn) and
/// never commit; whoever opened it commits or rolls back after the handler returned.
#[derive(Debug)]
pub struct BusinessTx(Open);

#[derive(Debug)]
enum Open {
    KeyedPg(IdempotentTx<Postgres>),
    KeyedSqlite(IdempotentTx<Sqlite>),
    KeyedMy(IdempotentTx<MySql>),
    Plain { tx: Option<Tx>, slot: PlainSlot },
}

impl BusinessTx {
    /// The transaction's connection, for statements (see [`Conn`]).
    pub fn conn(&mut self) -> Conn<'_> {
        match &mut self.0 {
            Open::KeyedPg(tx) => Conn::Pg(tx),
            Open::KeyedSqlite(tx) => Conn::Sqlite(tx),
            Open::KeyedMy(tx) => Conn::My(tx),
            Open::Plain { tx, .. } => tx.as_mut().expect("present until drop").conn(),
        }
    }
}

impl Drop for BusinessTx {
    fn drop(&mut self) {
        // An IdempotentTx goes back to the layer by its own drop; a plain one goes back here.
        if let Open::Plain { tx, slot } = &mut self.0 {
            *slot.lock() = tx.take();
        }
    }
}

/// Where [`plain_tx`] keeps the transaction while no handler holds it.
#[derive(Debug, Clone, Default)]
struct PlainSlot(Arc<Mutex<Option<Tx>>>);

impl PlainSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Tx>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// 500: a handler asked for the request's transaction, and there is none (the route has no
/// transaction layer, or the transaction was already taken).
pub(crate) fn no_tx() -> Problem {
    Problem::shop(
        StatusCode::INTERNAL_SERVER_ERROR,
        "no-transaction",
        "No transaction",
        "the route has no transaction layer, or the transaction was taken twice",
    )
}

impl FromRequestParts<App> for BusinessTx {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, app: &App) -> Result<Self, Response> {
        if let Some(slot) = parts.extensions.get::<PlainSlot>().cloned() {
            let tx = slot.lock().take();
            return match tx {
                Some(tx) => Ok(Self(Open::Plain { tx: Some(tx), slot })),
                None => Err(no_tx().into_response()),
            };
        }
        let open = match app.kind() {
            Kind::Postgres => IdempotentTx::from_request_parts(parts, app)
                .await
                .map(Open::KeyedPg),
            Kind::Sqlite => IdempotentTx::from_request_parts(parts, app)
                .await
                .map(Open::KeyedSqlite),
            Kind::Mysql => IdempotentTx::from_request_parts(parts, app)
                .await
                .map(Open::KeyedMy),
        };
        open.map(Self).map_err(IntoResponse::into_response)
    }
}

/// The key the layer reserved for this request, for a handler that settles it itself (the
/// durable purchase): the layer's [`KeyLease`] for the shop's backend.
#[derive(Debug)]
pub enum HeldKey {
    /// On PostgreSQL.
    Pg(KeyLease<PgStore>),
    /// On SQLite.
    Sqlite(KeyLease<SqliteStore>),
    /// On MariaDB.
    My(KeyLease<MySqlStore>),
}

impl FromRequestParts<App> for HeldKey {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, app: &App) -> Result<Self, Response> {
        let held = match app.kind() {
            Kind::Postgres => KeyLease::from_request_parts(parts, app)
                .await
                .map(HeldKey::Pg),
            Kind::Sqlite => KeyLease::from_request_parts(parts, app)
                .await
                .map(HeldKey::Sqlite),
            Kind::Mysql => KeyLease::from_request_parts(parts, app)
                .await
                .map(HeldKey::My),
        };
        held.map_err(IntoResponse::into_response)
    }
}

/// Middleware for routes without a key: runs the handler in a plain transaction, committed
/// after a 2xx or 3xx ([`idempotency_http::commits_writes`]) and rolled back otherwise. The
/// request runs in a task of its own, so a client that goes away does not cut it short.
pub async fn plain_tx(State(app): State<App>, request: Request, next: Next) -> Response {
    tokio::spawn(in_plain_tx(app, request, next))
        .await
        .unwrap_or_else(|_| Problem::panicked().into_response())
}

async fn in_plain_tx(app: App, mut request: Request, next: Next) -> Response {
    let tx = match app.db().begin().await {
        Ok(tx) => tx,
        Err(e) => return Problem::database(&e).into_response(),
    };
    let slot = PlainSlot(Arc::new(Mutex::new(Some(tx))));
    request.extensions_mut().insert(slot.clone());
    let mut response = next.run(request).await;
    // As behind the layer: only a success or a redirection commits the handler's writes.
    response.extensions_mut().remove::<Disposition>();
    let commit = idempotency_http::commits_writes(response.status());
    let Some(tx) = slot.lock().take() else {
        return no_tx().into_response();
    };
    if commit {
        if let Err(e) = tx.commit().await {
            return Problem::database(&e).into_response();
        }
    } else {
        let _ = tx.rollback().await;
    }
    response
}
