//! `application/problem+json` (RFC 9457) answers, and what the idempotency layer should do with
//! the key when a handler answers with one ([`Disposition`]).

use axum::{
    extract::{rejection::JsonRejection, FromRequest, Request},
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Json,
};
pub use idempotency_http::Disposition;
use idempotency_http::StoredResponse;
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

/// The media type of a problem document.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The base of the shop's problem `type` URIs (the middleware's own problems are
/// [`idempotency_http::problem_types`], under `https://idempotency.dev/problems/`).
///
/// ```
/// assert_eq!(shop::problem::TYPE_BASE, "https://idempotency.dev/problems/shop/");
/// ```
pub const TYPE_BASE: &str = "https://idempotency.dev/problems/shop/";

/// An RFC 9457 problem, answered with its status.
///
/// ```
/// use shop::problem::Problem;
/// let p = Problem::unprocessable("unknown-sku", "Unknown SKU", "no product 'x'");
/// assert_eq!(p.status().as_u16(), 422);
/// ```
#[derive(Debug, Clone)]
pub struct Problem(Box<ProblemBody>);

#[derive(Debug, Clone)]
struct ProblemBody {
    status: StatusCode,
    slug: &'static str,
    title: &'static str,
    detail: String,
    extra: Map<String, Value>,
    retry_after: Option<u64>,
    disposition: Option<Disposition>,
}

impl Problem {
    /// A problem with a status, a short slug (the `type` is [`TYPE_BASE`] + slug), a title and a
    /// human-readable detail.
    pub fn new(
        status: StatusCode,
        slug: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self(Box::new(ProblemBody {
            status,
            slug,
            title,
            detail: detail.into(),
            extra: Map::new(),
            retry_after: None,
            disposition: None,
        }))
    }

    /// 400: the request is malformed.
    pub fn bad_request(slug: &'static str, title: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, slug, title, detail)
    }

    /// 422: well-formed but not acceptable.
    pub fn unprocessable(
        slug: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, slug, title, detail)
    }

    /// 404.
    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", "Not found", detail)
    }

    /// 500 for a request whose handler panicked (its transaction rolled back, its key released).
    ///
    /// ```
    /// assert_eq!(shop::problem::Problem::panicked().status(), 500);
    /// ```
    pub fn panicked() -> Self {
        tracing::error!("a request handler panicked");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            "the request failed; nothing was kept, retry with the same Idempotency-Key",
        )
    }

    /// 500 for a database failure (details are logged, not shown).
    pub fn database(error: &sqlx::Error) -> Self {
        tracing::error!(%error, "database error");
        let status = match error {
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self::new(
            status,
            "database",
            "Database error",
            "the database failed; nothing was changed, retry with the same Idempotency-Key",
        )
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.0.status
    }

    /// Adds a member to the problem document.
    pub fn with(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.0.extra.insert(name.to_owned(), value.into());
        self
    }

    /// Adds a `Retry-After` header (seconds).
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.0.retry_after = Some(seconds);
        self
    }

    /// Marks the problem as a definitive answer, stored and replayed like a success.
    pub fn definitive(mut self) -> Self {
        self.0.disposition = Some(Disposition::Store);
        self
    }

    /// Marks the outcome as unknown: the key is parked as *needs review*.
    pub fn park(mut self, reason: impl Into<String>) -> Self {
        self.0.disposition = Some(Disposition::Park(reason.into()));
        self
    }
}

impl Problem {
    /// The problem document.
    fn document(&self) -> Value {
        let mut body = json!({
            "type": format!("{TYPE_BASE}{}", self.0.slug),
            "title": self.0.title,
            "status": self.0.status.as_u16(),
            "detail": self.0.detail,
        });
        if let Value::Object(map) = &mut body {
            map.extend(self.0.extra.clone());
        }
        body
    }

    /// The problem as a response kept with a key (a durable operation's definitive answer).
    ///
    /// ```
    /// let stored = shop::problem::Problem::not_found("no order 7").to_stored();
    /// assert_eq!(stored.status, 404);
    /// assert_eq!(stored.headers[0].1, "application/problem+json");
    /// ```
    pub fn to_stored(&self) -> StoredResponse {
        StoredResponse {
            status: self.0.status.as_u16(),
            headers: vec![("content-type".into(), PROBLEM_JSON.into())],
            body: serde_json::to_vec(&self.document()).expect("a JSON value serialises"),
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = self.document();
        let this = *self.0;
        let mut response = (this.status, Json(body)).into_response();
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(seconds) = this.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if let Some(disposition) = this.disposition {
            response.extensions_mut().insert(disposition);
        }
        response
    }
}

/// A JSON body whose rejections are problem documents: bad JSON → 400, wrong shape → 422,
/// missing `Content-Type: application/json` → 415, too large → 413.
#[derive(Debug, Clone)]
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(JsonBody(value)),
            Err(rejection) => Err(json_problem(&rejection)),
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
        JsonRejection::MissingJsonContentType(_) => Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "Unsupported media type",
            "send the body as JSON with Content-Type: application/json",
        ),
        _ if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => too_large(),
        _ => Problem::new(
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
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload-too-large",
        "Payload too large",
        format!("the request body is larger than {BODY_LIMIT} bytes"),
    )
}
