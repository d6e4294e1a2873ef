//! The response kept with a completed key and replayed to retries.

use axum::body::Body;
use base64::{engine::general_purpose::STANDARD, Engine as _};
use http::{header, HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use idempotency_wire::header::IDEMPOTENT_REPLAYED;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Headers that are never stored, whatever the configuration: cookies and credentials belong to
/// one response, not to every replay.
///
/// ```
/// assert!(idempotency_http::NEVER_STORED.contains(&http::header::SET_COOKIE));
/// ```
pub const NEVER_STORED: [HeaderName; 7] = [
    header::SET_COOKIE,
    header::COOKIE,
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    header::WWW_AUTHENTICATE,
    header::PROXY_AUTHENTICATE,
    HeaderName::from_static("set-cookie2"),
];

/// Headers always stored when present.
///
/// ```
/// assert!(idempotency_http::ALWAYS_STORED.contains(&http::header::LOCATION));
/// ```
pub const ALWAYS_STORED: [HeaderName; 2] = [header::CONTENT_TYPE, header::LOCATION];

/// The stored form of a response: what a replay sends back.
///
/// Serialised as JSON, with the body in standard base64:
/// `{"status":201,"headers":[["content-type","application/json"]],"body":"eyJpZCI6MX0="}`.
/// Header values that are not valid UTF-8 are not stored.
///
/// ```
/// use idempotency_http::StoredResponse;
/// let stored = StoredResponse {
///     status: 201,
///     headers: vec![("content-type".into(), "application/json".into())],
///     body: br#"{"id":1}"#.to_vec(),
/// };
/// let bytes = stored.to_bytes();
/// assert_eq!(
///     std::str::from_utf8(&bytes).unwrap(),
///     r#"{"status":201,"headers":[["content-type","application/json"]],"body":"eyJpZCI6MX0="}"#
/// );
/// assert_eq!(StoredResponse::from_bytes(&bytes).unwrap(), stored);
/// let replay = stored.into_replay();
/// assert_eq!(replay.status(), 201);
/// assert_eq!(replay.headers()["idempotent-replayed"], "true");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// The stored headers as `(lower-case name, value)` pairs, in response order.
    pub headers: Vec<(String, String)>,
    /// The response body, byte for byte.
    #[serde(serialize_with = "to_base64", deserialize_with = "from_base64")]
    pub body: Vec<u8>,
}

fn to_base64<S: Serializer>(body: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&STANDARD.encode(body))
}

fn from_base64<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let text = String::deserialize(d)?;
    STANDARD.decode(text).map_err(serde::de::Error::custom)
}

impl StoredResponse {
    /// Captures a response: its status, the headers `store` selects (plus `Content-Type` and
    /// `Location`, never cookies or credentials, see [`NEVER_STORED`]) and its body.
    ///
    /// ```
    /// use idempotency_http::StoredResponse;
    /// let mut headers = http::HeaderMap::new();
    /// headers.insert("content-type", "text/plain".parse().unwrap());
    /// headers.insert("set-cookie", "session=1".parse().unwrap());
    /// headers.insert("x-order-id", "7".parse().unwrap());
    /// let extra = [http::HeaderName::from_static("x-order-id")];
    /// let stored = StoredResponse::capture(http::StatusCode::CREATED, &headers, &extra, b"ok".to_vec());
    /// assert_eq!(stored.headers, vec![("content-type".to_owned(), "text/plain".to_owned()), ("x-order-id".to_owned(), "7".to_owned())]);
    /// ```
    pub fn capture(
        status: StatusCode,
        headers: &HeaderMap,
        store: &[HeaderName],
        body: Vec<u8>,
    ) -> Self {
        let mut kept = Vec::new();
        for (name, value) in headers {
            let selected = ALWAYS_STORED.contains(name) || store.contains(name);
            if !selected || NEVER_STORED.contains(name) {
                continue;
            }
            match value.to_str() {
                Ok(text) => kept.push((name.as_str().to_owned(), text.to_owned())),
                Err(_) => tracing::warn!(header = %name, "header value is not UTF-8; not stored"),
            }
        }
        Self {
            status: status.as_u16(),
            headers: kept,
            body,
        }
    }

    /// A JSON response: `status`, `Content-Type: application/json` and `value` serialised, the
    /// form a durable operation returns its answer in. Fails only for a value `serde_json`
    /// cannot write (a map with non-string keys).
    ///
    /// ```
    /// use idempotency_http::StoredResponse;
    /// let stored = StoredResponse::json(http::StatusCode::CREATED, &serde_json::json!({"id": 7})).unwrap();
    /// assert_eq!(stored.status, 201);
    /// assert_eq!(stored.headers, vec![("content-type".to_owned(), "application/json".to_owned())]);
    /// assert_eq!(stored.body, br#"{"id":7}"#);
    /// ```
    pub fn json(status: StatusCode, value: &impl Serialize) -> Result<Self, serde_json::Error> {
        Ok(Self {
            status: status.as_u16(),
            headers: vec![(
                header::CONTENT_TYPE.as_str().to_owned(),
                "application/json".to_owned(),
            )],
            body: serde_json::to_vec(value)?,
        })
    }

    /// The JSON bytes kept in the store.
    ///
    /// ```
    /// # use idempotency_http::StoredResponse;
    /// let bytes = StoredResponse { status: 200, headers: vec![], body: b"hi".to_vec() }.to_bytes();
    /// assert_eq!(bytes, br#"{"status":200,"headers":[],"body":"aGk="}"#);
    /// ```
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a StoredResponse always serialises")
    }

    /// Reads back the bytes of [`to_bytes`](Self::to_bytes).
    ///
    /// ```
    /// # use idempotency_http::StoredResponse;
    /// let stored = StoredResponse::from_bytes(br#"{"status":200,"headers":[],"body":"aGk="}"#).unwrap();
    /// assert_eq!(stored.body, b"hi");
    /// assert!(StoredResponse::from_bytes(b"{}").is_err());
    /// ```
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// The response as first sent (status, stored headers, body), without the replay marker.
    ///
    /// ```
    /// # use idempotency_http::StoredResponse;
    /// let r = StoredResponse { status: 204, headers: vec![], body: vec![] }.into_response();
    /// assert_eq!(r.status(), 204);
    /// assert!(r.headers().get("idempotent-replayed").is_none());
    /// ```
    pub fn into_response(self) -> Response<Body> {
        let mut response = Response::new(Body::from(self.body));
        *response.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let headers = response.headers_mut();
        for (name, value) in self.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(&value),
            ) {
                headers.append(name, value);
            }
        }
        response
    }

    /// The response a retry receives: [`into_response`](Self::into_response) plus
    /// `Idempotent-Replayed: true`.
    ///
    /// ```
    /// # use idempotency_http::StoredResponse;
    /// let r = StoredResponse { status: 201, headers: vec![("location".into(), "/orders/1".into())], body: vec![] }.into_replay();
    /// assert_eq!(r.headers()["location"], "/orders/1");
    /// assert_eq!(r.headers()["idempotent-replayed"], "true");
    /// ```
    pub fn into_replay(self) -> Response<Body> {
        self.into_replay_marked(IDEMPOTENT_REPLAYED)
    }

    /// [`into_replay`](Self::into_replay) with another marker header (see
    /// [`IdempotencyLayer::with_replay_header`](crate::IdempotencyLayer::with_replay_header)).
    ///
    /// ```
    /// # use idempotency_http::StoredResponse;
    /// let stored = StoredResponse { status: 201, headers: vec![], body: vec![] };
    /// let r = stored.into_replay_marked(http::HeaderName::from_static("idempotency-replayed"));
    /// assert_eq!(r.headers()["idempotency-replayed"], "true");
    /// assert!(r.headers().get("idempotent-replayed").is_none());
    /// ```
    pub fn into_replay_marked(self, header: http::HeaderName) -> Response<Body> {
        let mut response = self.into_response();
        response
            .headers_mut()
            .insert(header, HeaderValue::from_static("true"));
        response
    }
}

/// A stored response answers a request as first sent (no replay marker), so that a handler can
/// return one: the answer of a durable operation, for example.
///
/// ```
/// use axum::response::IntoResponse;
/// use idempotency_http::StoredResponse;
/// let stored = StoredResponse::json(http::StatusCode::CREATED, &serde_json::json!({"id": 7})).unwrap();
/// let response = IntoResponse::into_response(stored);
/// assert_eq!(response.status(), 201);
/// assert_eq!(response.headers()["content-type"], "application/json");
/// ```
impl axum::response::IntoResponse for StoredResponse {
    fn into_response(self) -> axum::response::Response {
        StoredResponse::into_response(self)
    }
}

/// The stored answer of a finished durable operation
/// ([`Idempotency::perform_reserved`](idempotency::Idempotency::perform_reserved)), to return
/// from the handler.
///
/// ```
/// # fn demo(finished: idempotency::durable::Finished<idempotency_http::StoredResponse>) -> axum::response::Response {
/// use axum::response::IntoResponse;
/// use idempotency_http::StoredResponse;
/// StoredResponse::from(finished).into_response()
/// # }
/// ```
impl From<idempotency::durable::Finished<StoredResponse>> for StoredResponse {
    fn from(finished: idempotency::durable::Finished<StoredResponse>) -> Self {
        finished.into_response()
    }
}
