//! [`IdempotentTx`]: the business transaction, handed from the layer to the handler and back.
//!
//! The layer puts a slot into the request's extensions. Extracting [`IdempotentTx`] begins the
//! transaction (lazily, through [`Store::begin`](idempotency::Store::begin)) and lends it to the
//! handler; dropping the extractor (when the handler returns) gives it back to the slot. After the
//! handler returned, the layer takes it out and completes the key **in it**
//! ([`Lease::finish`](idempotency::Lease::finish)), so the handler's rows and the stored response
//! commit together or not at all.

use crate::problem::Problem;
use axum::{
    extract::FromRequestParts,
    response::{IntoResponse, Response},
};
use futures_util::future::BoxFuture;
use http::request::Parts;
use idempotency::StoreError;
use idempotency_wire::{ProblemType, DEFAULT_PROBLEM_BASE};
use std::{
    ops::{Deref, DerefMut},
    sync::{Arc, Mutex},
};

type Begin<DB> = Arc<
    dyn Fn() -> BoxFuture<'static, Result<sqlx::Transaction<'static, DB>, StoreError>>
        + Send
        + Sync,
>;

enum SlotState<DB: sqlx::Database> {
    /// Not begun yet.
    Unopened,
    /// Begun and not lent (or given back).
    Open(sqlx::Transaction<'static, DB>),
    /// Lent to an [`IdempotentTx`] that has not been dropped yet.
    Lent,
}

/// What the layer finds in the slot once the handler returned.
pub(crate) enum Returned<DB: sqlx::Database> {
    /// The handler never extracted the transaction.
    NotBegun,
    /// The transaction the handler wrote in.
    Open(sqlx::Transaction<'static, DB>),
    /// The handler still holds the transaction (moved it into a task, kept it in a stream …).
    StillLent,
}

/// The request-extension slot shared by the layer and the extractor.
pub(crate) struct TxSlot<DB: sqlx::Database> {
    state: Arc<Mutex<SlotState<DB>>>,
    begin: Begin<DB>,
}

impl<DB: sqlx::Database> Clone for TxSlot<DB> {
    fn clone(&self) -> Self {
        Self {
            state: self.state.clone(),
            begin: self.begin.clone(),
        }
    }
}

impl<DB: sqlx::Database> TxSlot<DB> {
    /// A slot that begins the transaction on `store` when the handler first extracts it, or
    /// holds `open`, begun already (the key was reserved inside it).
    pub(crate) fn new<S>(store: S, open: Option<sqlx::Transaction<'static, DB>>) -> Self
    where
        S: idempotency::Store<Database = DB>,
    {
        let begin: Begin<DB> = Arc::new(move || {
            let store = store.clone();
            Box::pin(async move { store.begin().await })
        });
        let state = match open {
            Some(tx) => SlotState::Open(tx),
            None => SlotState::Unopened,
        };
        Self {
            state: Arc::new(Mutex::new(state)),
            begin,
        }
    }

    pub(crate) fn take_back(&self) -> Returned<DB> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(&mut *state, SlotState::Unopened) {
            SlotState::Unopened => Returned::NotBegun,
            SlotState::Open(tx) => Returned::Open(tx),
            SlotState::Lent => {
                *state = SlotState::Lent;
                Returned::StillLent
            }
        }
    }
}

/// Why [`IdempotentTx`] could not be extracted; answered as a problem response.
///
/// ```
/// use axum::response::IntoResponse;
/// use idempotency_http::TxRejection;
/// assert_eq!(TxRejection::LayerMissing.into_response().status(), 500);
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TxRejection {
    /// No [`IdempotencyLayer`](crate::IdempotencyLayer) for this database wraps the route.
    #[error("IdempotentTx used on a route without an IdempotencyLayer for this database")]
    LayerMissing,
    /// The handler extracted the transaction twice at the same time.
    #[error("IdempotentTx extracted twice in one request")]
    AlreadyLent,
    /// The transaction could not be begun (answered with 503).
    #[error("could not begin the business transaction: {0}")]
    Begin(#[source] StoreError),
}

impl TxRejection {
    /// The problem response for this rejection.
    ///
    /// ```
    /// # use idempotency_http::TxRejection;
    /// assert_eq!(TxRejection::AlreadyLent.to_problem().status, 500);
    /// ```
    pub fn to_problem(&self) -> Problem {
        let problem_type = match self {
            TxRejection::Begin(_) => ProblemType::StoreUnavailable,
            _ => ProblemType::Internal,
        };
        Problem::of(problem_type, DEFAULT_PROBLEM_BASE).with_detail(self.to_string())
    }
}

impl IntoResponse for TxRejection {
    fn into_response(self) -> Response {
        self.to_problem().into_response()
    }
}

/// The business transaction of a protected request, as an axum extractor.
///
/// Write the handler's rows through it (`&mut **tx` is the connection); do **not** commit it: when
/// the handler returns, the layer completes the idempotency key in this transaction and commits
/// both together. Only a success or a redirection (2xx, 3xx) commits it
/// ([`commits_writes`](crate::commits_writes)); after any other response it is rolled back, even
/// when that response is stored (a definitive 422 is stored without the handler's writes). On
/// routes where the request runs unprotected (optional key absent, method not protected) the
/// same rule applies: committed after a 2xx or 3xx, rolled back otherwise.
///
/// Do not keep it past the response (in a spawned task or a streaming body): the layer then
/// answers 500 and releases the key.
///
/// ```no_run
/// use idempotency_http::IdempotentTx;
/// use sqlx::Postgres;
///
/// async fn create_order(mut tx: IdempotentTx<Postgres>) -> (http::StatusCode, String) {
///     let id: i64 = sqlx::query_scalar("INSERT INTO orders (sku) VALUES ('tea') RETURNING id")
///         .fetch_one(&mut **tx)
///         .await
///         .unwrap();
///     (http::StatusCode::CREATED, format!("order {id}"))
/// }
/// # let _ = axum::Router::<()>::new().route("/orders", axum::routing::post(create_order));
/// ```
pub struct IdempotentTx<DB: sqlx::Database> {
    tx: Option<sqlx::Transaction<'static, DB>>,
    state: Arc<Mutex<SlotState<DB>>>,
}

impl<DB: sqlx::Database> std::fmt::Debug for IdempotentTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentTx").finish_non_exhaustive()
    }
}

impl<DB: sqlx::Database> Deref for IdempotentTx<DB> {
    type Target = sqlx::Transaction<'static, DB>;
    fn deref(&self) -> &Self::Target {
        self.tx.as_ref().expect("present until drop")
    }
}

impl<DB: sqlx::Database> DerefMut for IdempotentTx<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.tx.as_mut().expect("present until drop")
    }
}

impl<DB: sqlx::Database> Drop for IdempotentTx<DB> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            *state = SlotState::Open(tx);
        }
    }
}

impl<DB: sqlx::Database, AppState: Send + Sync> FromRequestParts<AppState> for IdempotentTx<DB> {
    type Rejection = TxRejection;

    async fn from_request_parts(parts: &mut Parts, _: &AppState) -> Result<Self, Self::Rejection> {
        let slot = parts
            .extensions
            .get::<TxSlot<DB>>()
            .cloned()
            .ok_or(TxRejection::LayerMissing)?;
        let open = {
            let mut state = slot.state.lock().unwrap_or_else(|e| e.into_inner());
            match std::mem::replace(&mut *state, SlotState::Lent) {
                SlotState::Open(tx) => Some(tx),
                SlotState::Unopened => None,
                SlotState::Lent => return Err(TxRejection::AlreadyLent),
            }
        };
        let tx = match open {
            Some(tx) => tx,
            None => match (slot.begin)().await {
                Ok(tx) => tx,
                Err(e) => {
                    *slot.state.lock().unwrap_or_else(|e| e.into_inner()) = SlotState::Unopened;
                    return Err(TxRejection::Begin(e));
                }
            },
        };
        Ok(Self {
            tx: Some(tx),
            state: slot.state,
        })
    }
}
