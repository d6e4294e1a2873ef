//! `application/problem+json` responses (RFC 9457) with stable `type` URIs.
//!
//! Every refusal of the layer is a [`Problem`] of one of the
//! [`ProblemType`](idempotency_wire::ProblemType)s; applications can build their own (401, 400 …)
//! with the same helper so that clients see one error format.

use crate::{Disposition, StoredResponse};
use axum::{
    body::Body,
    response::{IntoResponse, Response},
};
use http::{header, HeaderValue, StatusCode};
use idempotency_wire::{ProblemType, KEY_STATE_MEMBER, PROBLEM_JSON, RETRY_MEMBER};
use serde::Serialize;
use serde_json::{Map, Value};
use std::time::Duration;

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

    /// The layer's problem of kind `problem_type`, its `type` under `base`
    /// ([`DEFAULT_PROBLEM_BASE`](idempotency_wire::DEFAULT_PROBLEM_BASE) unless the layer was
    /// given another): its status and title, and the extension members that tell a client what
    /// to do next, `retry` and, where known, `key_state` (see [`idempotency_wire`]).
    ///
    /// ```
    /// use idempotency_http::Problem;
    /// use idempotency_wire::{ProblemType, DEFAULT_PROBLEM_BASE};
    /// let problem = Problem::of(ProblemType::InProgress, DEFAULT_PROBLEM_BASE);
    /// assert_eq!(problem.status(), 409);
    /// let document = serde_json::to_value(&problem).unwrap();
    /// assert_eq!(document["type"], "tag:idempotency,2026:problems/in-progress");
    /// assert_eq!(document["retry"], "same-key");
    /// assert_eq!(document["key_state"], "pending");
    /// ```
    pub fn of(problem_type: ProblemType, base: &str) -> Self {
        let problem = Self::new(
            problem_type.status(),
            problem_type.type_uri(base),
            problem_type.title(),
        )
        .with_extension(RETRY_MEMBER, problem_type.retry().as_str());
        match problem_type.key_state() {
            Some(state) => problem.with_extension(KEY_STATE_MEMBER, state),
            None => problem,
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
        let in_progress = "https://errors.example.com/in-progress";
        let response = Problem::new(StatusCode::CONFLICT, in_progress, "In progress")
            .with_detail("wait")
            .with_retry_after(Duration::from_millis(2001))
            .into_http_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "3");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"type": in_progress, "title": "In progress", "status": 409, "detail": "wait"})
        );
    }
}
