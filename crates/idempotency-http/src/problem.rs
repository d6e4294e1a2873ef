//! `application/problem+json` responses (RFC 9457) with stable `type` URIs.
//!
//! Every refusal of the layer is a [`Problem`]; applications can build their own (401, 400 …) with
//! the same helper so that clients see one error format.

use crate::{Disposition, StoredResponse};
use axum::{
    body::Body,
    response::{IntoResponse, Response},
};
use http::{header, HeaderValue, StatusCode};
use serde::Serialize;
use serde_json::{Map, Value};
use std::time::Duration;

/// The media type of problem documents.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The default base of the layer's problem `type` URIs: each type is this base followed by a
/// slug (`key-reused`, `in-progress` …). The URIs are identifiers, not documents: nothing is
/// served there. Put the types under a base you control, where you can document them for your
/// clients, with [`IdempotencyLayer::with_problem_base`](crate::IdempotencyLayer::with_problem_base);
/// the slugs stay the same.
pub const DEFAULT_PROBLEM_BASE: &str = "https://idempotency.dev/problems/";

/// The stable `type` URIs of the problems this crate answers with (under [`DEFAULT_PROBLEM_BASE`]).
///
/// ```
/// use idempotency_http::problem_types;
/// assert_eq!(problem_types::KEY_REUSED, "https://idempotency.dev/problems/key-reused");
/// ```
pub mod types {
    /// 400: the route requires an `Idempotency-Key` header and the request has none.
    pub const KEY_MISSING: &str = "https://idempotency.dev/problems/key-missing";
    /// 400: the `Idempotency-Key` header is malformed, repeated or too long.
    pub const KEY_INVALID: &str = "https://idempotency.dev/problems/key-invalid";
    /// 401: no scope (user, tenant) could be found for the request.
    pub const SCOPE_MISSING: &str = "https://idempotency.dev/problems/scope-missing";
    /// 409: a request with the same key is still being processed; retry after `Retry-After`.
    pub const IN_PROGRESS: &str = "https://idempotency.dev/problems/in-progress";
    /// 409: the key is parked for an operator: an outside effect may or may not have happened.
    pub const NEEDS_REVIEW: &str = "https://idempotency.dev/problems/needs-review";
    /// 409: the lease on the key was lost while the handler ran; its work was rolled back.
    pub const LEASE_LOST: &str = "https://idempotency.dev/problems/lease-lost";
    /// 422: the key was already used with a different request.
    pub const KEY_REUSED: &str = "https://idempotency.dev/problems/key-reused";
    /// 413: the request body is larger than the layer's limit.
    pub const BODY_TOO_LARGE: &str = "https://idempotency.dev/problems/body-too-large";
    /// 400: the request declares a JSON content type but its body is not JSON.
    pub const BODY_NOT_JSON: &str = "https://idempotency.dev/problems/body-not-json";
    /// 400: the request body could not be read.
    pub const BODY_UNREADABLE: &str = "https://idempotency.dev/problems/body-unreadable";
    /// 503: a durable operation did not settle in this request (an outside outcome is unknown,
    /// or it stopped after a step took effect): it is carried on in the background; retry with
    /// the same key after `Retry-After`.
    pub const OPERATION_PENDING: &str = "https://idempotency.dev/problems/operation-pending";
    /// 503: the idempotency store cannot be reached; nothing was run.
    pub const STORE_UNAVAILABLE: &str = "https://idempotency.dev/problems/store-unavailable";
    /// 500: an internal failure (corrupt stored response, misuse of the transaction extractor …).
    pub const INTERNAL: &str = "https://idempotency.dev/problems/internal";
}

/// One RFC 9457 problem document, and the HTTP response that carries it.
///
/// ```
/// use axum::response::IntoResponse;
/// use http::StatusCode;
/// use idempotency_http::Problem;
///
/// let response = Problem::new(StatusCode::UNAUTHORIZED, "https://shop.example/problems/login", "Log in first")
///     .with_detail("the session cookie is missing")
///     .into_response();
/// assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// A URI naming the kind of problem; clients match on it.
    #[serde(rename = "type")]
    pub type_uri: String,
    /// A short, human-readable summary of the kind of problem (the same for every occurrence).
    pub title: String,
    /// The HTTP status code.
    #[serde(serialize_with = "serialize_status")]
    pub status: StatusCode,
    /// An explanation of this occurrence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Sent as a `Retry-After` header in whole seconds (at least 1), not in the document.
    #[serde(skip)]
    pub retry_after: Option<Duration>,
    /// Extension members, and what the layer does with the key after this answer.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    more: Option<Box<More>>,
}

/// The rarer parts of a problem, boxed to keep `Result<T, Problem>` small.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
struct More {
    /// RFC 9457 extension members, serialised beside `type`, `title` …
    #[serde(flatten)]
    extensions: Map<String, Value>,
    /// Inserted into the response's extensions for the layer.
    #[serde(skip)]
    disposition: Option<Disposition>,
}

fn serialize_status<S: serde::Serializer>(status: &StatusCode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u16(status.as_u16())
}

impl Problem {
    /// A problem of kind `type_uri` with `title`, answered with `status`.
    pub fn new(status: StatusCode, type_uri: impl Into<String>, title: impl Into<String>) -> Self {
        Self {
            type_uri: type_uri.into(),
            title: title.into(),
            status,
            detail: None,
            retry_after: None,
            more: None,
        }
    }

    /// The HTTP status.
    ///
    /// ```
    /// # use idempotency_http::Problem;
    /// assert_eq!(Problem::new(http::StatusCode::GONE, "about:blank", "Gone").status(), 410);
    /// ```
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Adds an extension member to the document (RFC 9457, section 3.2). A member named like
    /// one of the standard ones (`type`, `title`, `status`, `detail`, `instance`) is ignored.
    ///
    /// ```
    /// # use idempotency_http::Problem;
    /// let p = Problem::new(http::StatusCode::UNPROCESSABLE_ENTITY, "about:blank", "Out of stock")
    ///     .with_extension("sku", "tea")
    ///     .with_extension("available", 0);
    /// let document = serde_json::to_value(&p).unwrap();
    /// assert_eq!(document["sku"], "tea");
    /// assert_eq!(document["available"], 0);
    /// ```
    pub fn with_extension(mut self, name: &str, value: impl Into<Value>) -> Self {
        if !matches!(name, "type" | "title" | "status" | "detail" | "instance") {
            let more = self.more.get_or_insert_with(Box::default);
            more.extensions.insert(name.to_owned(), value.into());
        }
        self
    }

    /// Says what the layer does with the key after this answer (see [`Disposition`]); without
    /// it the status decides ([`is_definitive`](crate::is_definitive)).
    ///
    /// ```
    /// use axum::response::IntoResponse;
    /// use idempotency_http::{Disposition, Problem};
    /// let refusal = Problem::new(http::StatusCode::PAYMENT_REQUIRED, "about:blank", "Balance too low")
    ///     .with_disposition(Disposition::Store)
    ///     .into_response();
    /// assert_eq!(refusal.extensions().get::<Disposition>(), Some(&Disposition::Store));
    /// ```
    pub fn with_disposition(mut self, disposition: Disposition) -> Self {
        self.more.get_or_insert_with(Box::default).disposition = Some(disposition);
        self
    }

    /// The JSON document (`{}` if it cannot be serialised, which a map of JSON values cannot
    /// cause).
    fn document(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_else(|_| b"{}".to_vec())
    }

    /// The problem as a response kept with a key (for example a durable operation's definitive
    /// answer): status, `Content-Type` and the document (no `Retry-After`).
    ///
    /// ```
    /// # use idempotency_http::Problem;
    /// let stored = Problem::new(http::StatusCode::NOT_FOUND, "about:blank", "Not found").to_stored();
    /// assert_eq!(stored.status, 404);
    /// assert_eq!(stored.headers[0].1, "application/problem+json");
    /// ```
    pub fn to_stored(&self) -> StoredResponse {
        StoredResponse {
            status: self.status.as_u16(),
            headers: vec![("content-type".into(), PROBLEM_JSON.into())],
            body: self.document(),
        }
    }

    /// Adds an explanation of this occurrence.
    ///
    /// ```
    /// # use idempotency_http::Problem;
    /// let p = Problem::new(http::StatusCode::BAD_REQUEST, "about:blank", "Bad request").with_detail("sku is empty");
    /// assert_eq!(p.detail.as_deref(), Some("sku is empty"));
    /// ```
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds a `Retry-After` header (rounded up to whole seconds, at least 1).
    ///
    /// ```
    /// # use idempotency_http::Problem;
    /// # use std::time::Duration;
    /// let r = Problem::new(http::StatusCode::CONFLICT, "about:blank", "Busy")
    ///     .with_retry_after(Duration::from_millis(10))
    ///     .into_http_response();
    /// assert_eq!(r.headers()["retry-after"], "1");
    /// ```
    pub fn with_retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = Some(retry_after);
        self
    }

    /// The `Retry-After` value in whole seconds, rounded up, at least 1.
    ///
    /// ```
    /// # use idempotency_http::Problem;
    /// # use std::time::Duration;
    /// assert_eq!(Problem::retry_after_seconds(Duration::from_millis(1500)), 2);
    /// assert_eq!(Problem::retry_after_seconds(Duration::ZERO), 1);
    /// ```
    pub fn retry_after_seconds(retry_after: Duration) -> u64 {
        let whole = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
        whole.max(1)
    }

    /// The response: status, `Content-Type: application/problem+json`, optional `Retry-After`,
    /// and the JSON document.
    ///
    /// ```
    /// # use idempotency_http::Problem;
    /// let r = Problem::new(http::StatusCode::NOT_FOUND, "about:blank", "Not found").into_http_response();
    /// assert_eq!(r.status(), 404);
    /// ```
    pub fn into_http_response(self) -> Response<Body> {
        let body = self.document();
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(retry_after) = self.retry_after {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from(Self::retry_after_seconds(retry_after)),
            );
        }
        if let Some(disposition) = self.more.and_then(|more| more.disposition) {
            response.extensions_mut().insert(disposition);
        }
        response
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        self.into_http_response()
    }
}

/// axum's refusal of a JSON body (wrong content type, syntax error, wrong shape) as a problem
/// document with the same status (400, 415 or 422), the RFC's generic type `about:blank` with
/// the status's reason phrase as title, and axum's explanation as `detail`; so that a service's
/// own validation errors come in the same format as the layer's.
///
/// ```
/// use axum::{extract::rejection::JsonRejection, response::IntoResponse, Json};
/// use idempotency_http::Problem;
///
/// #[derive(serde::Deserialize)]
/// struct NewOrder { sku: String }
///
/// async fn create(order: Result<Json<NewOrder>, JsonRejection>) -> Result<String, Problem> {
///     let Json(order) = order?; // `?` turns the rejection into a problem+json answer
///     Ok(order.sku)
/// }
/// ```
impl From<axum::extract::rejection::JsonRejection> for Problem {
    fn from(rejection: axum::extract::rejection::JsonRejection) -> Self {
        let status = rejection.status();
        Problem::new(
            status,
            "about:blank",
            status.canonical_reason().unwrap_or("Invalid JSON body"),
        )
        .with_detail(rejection.body_text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_json_rejection_is_a_problem_with_its_status() {
        use axum::{extract::FromRequest, Json};
        let request = http::Request::builder()
            .method("POST")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from("{not json"))
            .unwrap();
        let rejection = Json::<serde_json::Value>::from_request(request, &())
            .await
            .expect_err("not JSON");
        let response = Problem::from(rejection).into_http_response();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let document: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(document["type"], "about:blank");
        assert_eq!(document["title"], "Bad Request");
        assert!(document["detail"].as_str().unwrap().contains("JSON"));
    }

    #[tokio::test]
    async fn problem_document_has_rfc9457_members() {
        let response = Problem::new(StatusCode::CONFLICT, types::IN_PROGRESS, "In progress")
            .with_detail("wait")
            .with_retry_after(Duration::from_millis(2001))
            .into_http_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "3");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"type": types::IN_PROGRESS, "title": "In progress", "status": 409, "detail": "wait"})
        );
    }
}
