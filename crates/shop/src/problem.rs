//! `application/problem+json` (RFC 9457) answers, and what the idempotency layer should do with
//! the key when a handler answers with one ([`Disposition`]).

use axum::{
    extract::{rejection::JsonRejection, FromRequest, Request},
    http::StatusCode,
    Json,
};
pub use idempotency_http::Disposition;
use serde::de::DeserializeOwned;

/// The base of the shop's problem `type` URIs (the middleware's own problems are the
/// [`ProblemType`](idempotency_http::wire::ProblemType)s, under
/// [`DEFAULT_PROBLEM_BASE`](idempotency_http::wire::DEFAULT_PROBLEM_BASE)).
///
/// ```
/// assert_eq!(shop::problem::TYPE_BASE, "tag:idempotency,2026:problems/shop/");
/// ```
pub const TYPE_BASE: &str = "tag:idempotency,2026:problems/shop/";

pub use idempotency_http::Problem;

/// The shop's problems: the HTTP crate's [`Problem`], with types under [`TYPE_BASE`].
///
/// ```
/// use shop::problem::{Problem, ShopProblem};
/// let p = Problem::unprocessable("unknown-sku", "Unknown SKU", "no product 'x'");
/// assert_eq!(p.status().as_u16(), 422);
/// assert_eq!(p.type_uri, "tag:idempotency,2026:problems/shop/unknown-sku");
/// ```
pub trait ShopProblem: Sized {
    /// A problem with a status, a short slug (the `type` is [`TYPE_BASE`] + slug), a title and a
    /// human-readable detail.
    fn shop(status: StatusCode, slug: &str, title: &str, detail: impl Into<String>) -> Self;

    /// 400: the request is malformed.
    fn bad_request(slug: &str, title: &str, detail: impl Into<String>) -> Self {
        Self::shop(StatusCode::BAD_REQUEST, slug, title, detail)
    }

    /// 422: well-formed but not acceptable.
    fn unprocessable(slug: &str, title: &str, detail: impl Into<String>) -> Self {
        Self::shop(StatusCode::UNPROCESSABLE_ENTITY, slug, title, detail)
    }

    /// 404.
    fn not_found(detail: impl Into<String>) -> Self {
        Self::shop(StatusCode::NOT_FOUND, "not-found", "Not found", detail)
    }

    /// 500 for a request whose handler panicked (its transaction rolled back, its key released).
    ///
    /// ```
    /// use shop::problem::{Problem, ShopProblem};
    /// assert_eq!(Problem::panicked().status(), 500);
    /// ```
    fn panicked() -> Self {
        tracing::error!("a request handler panicked");
        Self::shop(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            "the request failed; nothing was kept, retry with the same Idempotency-Key",
        )
    }

    /// 500 for a database failure, 503 with `Retry-After: 1` when the database cannot be
    /// reached or has no room to write (`idempotency::store::is_unavailable_error`; details are
    /// logged, not shown).
    ///
    /// ```
    /// use shop::problem::{Problem, ShopProblem};
    /// let down = Problem::database(&sqlx::Error::PoolTimedOut);
    /// assert_eq!(down.status(), 503);
    /// assert!(down.retry_after.is_some());
    /// ```
    fn database(error: &sqlx::Error) -> Self;
}

impl ShopProblem for Problem {
    fn shop(status: StatusCode, slug: &str, title: &str, detail: impl Into<String>) -> Self {
        Problem::new(status, format!("{TYPE_BASE}{slug}"), title).with_detail(detail)
    }

    fn database(error: &sqlx::Error) -> Self {
        tracing::error!(%error, "database error");
        let detail =
            "the database failed; nothing was changed, retry with the same Idempotency-Key";
        if idempotency::store::is_unavailable_error(error) {
            Self::shop(
                StatusCode::SERVICE_UNAVAILABLE,
                "database",
                "Database error",
                detail,
            )
            .with_retry_after(std::time::Duration::from_secs(1))
        } else {
            Self::shop(
                StatusCode::INTERNAL_SERVER_ERROR,
                "database",
                "Database error",
                detail,
            )
        }
    }
}

/// A JSON body whose rejections are problem documents: bad JSON → 400, wrong shape → 422,
/// missing `Content-Type: application/json` → 415, too large → 413. A rejection releases the
/// key of a keyed route (the handler never ran), whatever the route's effects.
#[derive(Debug, Clone)]
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(JsonBody(value)),
            // The handler never ran: nothing happened that a retry could duplicate.
            Err(rejection) => Err(json_problem(&rejection).with_disposition(Disposition::Release)),
        }
    }
}

fn json_problem(rejection: &JsonRejection) -> Problem {
    let detail = rejection.body_text();
    match rejection {
        JsonRejection::JsonDataError(_) => {
            Problem::unprocessable("invalid-body", "Invalid request body", detail)
        }
        JsonRejection::JsonSyntaxError(_) => {
            Problem::bad_request("malformed-json", "Malformed JSON", detail)
        }
        JsonRejection::MissingJsonContentType(_) => Problem::shop(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "Unsupported media type",
            "send the body as JSON with Content-Type: application/json",
        ),
        _ if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => too_large(),
        _ => Problem::shop(
            rejection.status(),
            "invalid-body",
            "Invalid request body",
            detail,
        ),
    }
}

/// Largest accepted request body, in bytes.
pub const BODY_LIMIT: usize = 16 * 1024;

/// 413 for a body over [`BODY_LIMIT`].
pub fn too_large() -> Problem {
    Problem::shop(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload-too-large",
        "Payload too large",
        format!("the request body is larger than {BODY_LIMIT} bytes"),
    )
}
