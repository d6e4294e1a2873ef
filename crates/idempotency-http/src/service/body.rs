//! Step 1: what the request asks for. Its operation name, its body read within the limit, and
//! its fingerprint (method, path and query, the configured headers, the body as canonical JSON
//! or raw bytes). Nothing is reserved here; a refusal (400, 413, 500) is the answer.

use super::{answer::refuse, Handler, KeyedCall};
use crate::{
    config::OperationSource,
    error::{BoxError, IdempotencyRejection, InternalError},
};
use axum::{body::Body, extract::MatchedPath};
use bytes::Bytes;
use http::{header, request::Parts, HeaderMap, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idempotency::{Attempt, Fingerprint, IdempotencyKey, Store};

/// The request's attempt (key and fingerprint), its body kept in `call` for the handler.
pub(super) async fn prepare<S: Store, H: Handler>(
    call: &mut KeyedCall<S, H>,
    body: Body,
    client_key: String,
    scope: String,
) -> Result<Attempt, Response<Body>> {
    let config = &call.layer.config;
    let refused = |rejection| refuse(&config.problem_base, &call.operation, rejection);
    // The client key was validated with the header; only a bad scope or operation fails here.
    let key = IdempotencyKey::new(scope, call.operation.as_str(), client_key)
        .map_err(|invalid| refused(InternalError::InvalidKey(invalid).into()))?;
    let bytes = read_body(body, &call.parts.headers, config.body_limit)
        .await
        .map_err(refused)?;
    let fingerprint =
        fingerprint(&call.parts, &config.fingerprint_headers, &bytes).map_err(refused)?;
    call.body = bytes;
    Ok(Attempt::new(key, fingerprint)
        .with_effects(config.effects)
        .with_journaled(config.journaled))
}

/// The key's operation: `METHOD /route/{template}` by default.
pub(super) fn operation_name(source: &OperationSource, parts: &Parts) -> String {
    match source {
        OperationSource::Fixed(name) => name.clone(),
        OperationSource::Custom(name) => name(parts),
        OperationSource::MethodAndRoute => {
            let path = parts
                .extensions
                .get::<MatchedPath>()
                .map(MatchedPath::as_str)
                .unwrap_or_else(|| parts.uri.path());
            format!("{} {}", parts.method, path)
        }
    }
}

/// The body, read whole within `limit` bytes (a `Content-Length` over it is refused unread).
async fn read_body<B>(
    body: B,
    headers: &HeaderMap,
    limit: usize,
) -> Result<Bytes, IdempotencyRejection>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(IdempotencyRejection::BodyTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => {
            Err(IdempotencyRejection::BodyTooLarge { limit })
        }
        Err(error) => Err(IdempotencyRejection::BodyUnreadable(error)),
    }
}

/// Whether a `Content-Type` is JSON: `application/json` or any `+json` suffix.
fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json") || subtype.to_ascii_lowercase().ends_with("+json"))
}

/// Method, path and query, the configured headers, and the body (canonical JSON or raw bytes).
fn fingerprint(
    parts: &Parts,
    fingerprint_headers: &[http::HeaderName],
    body: &[u8],
) -> Result<Fingerprint, IdempotencyRejection> {
    let target = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |pq| pq.as_str());
    let mut builder = Fingerprint::builder()
        .part("method", parts.method.as_str().as_bytes())
        .part("target", target.as_bytes());
    for name in fingerprint_headers {
        for value in parts.headers.get_all(name) {
            builder = builder.part(&format!("header {name}"), value.as_bytes());
        }
    }
    let builder = if is_json(&parts.headers) {
        builder
            .json_part("json body", body)
            .map_err(IdempotencyRejection::BodyNotJson)?
    } else {
        builder.part("body", body)
    };
    Ok(builder.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderValue, Request};

    #[tokio::test]
    async fn body_limit_holds_without_content_length() {
        let headers = HeaderMap::new();
        let body = http_body_util::Full::new(Bytes::from(vec![b'x'; 2000]));
        assert!(matches!(
            read_body(body, &headers, 1999).await,
            Err(IdempotencyRejection::BodyTooLarge { limit: 1999 })
        ));
        let body = http_body_util::Full::new(Bytes::from(vec![b'x'; 2000]));
        assert_eq!(read_body(body, &headers, 2000).await.unwrap().len(), 2000);
        let mut lying = HeaderMap::new();
        lying.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5000"));
        let body = http_body_util::Full::new(Bytes::from_static(b"small"));
        assert!(matches!(
            read_body(body, &lying, 2000).await,
            Err(IdempotencyRejection::BodyTooLarge { .. })
        ));
    }

    #[test]
    fn recognises_json_content_types() {
        let mut headers = HeaderMap::new();
        assert!(!is_json(&headers));
        for (value, json) in [
            ("application/json", true),
            ("application/json; charset=utf-8", true),
            ("Application/JSON", true),
            ("application/merge-patch+json", true),
            ("text/plain", false),
            ("application/x-www-form-urlencoded", false),
            ("json", false),
        ] {
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(value));
            assert_eq!(is_json(&headers), json, "{value}");
        }
    }

    #[test]
    fn fingerprint_separates_method_path_headers_and_body() {
        let request = |method: &str, uri: &str, currency: &str| {
            let (parts, ()) = Request::builder()
                .method(method)
                .uri(uri)
                .header("content-type", "application/json")
                .header("x-currency", currency)
                .body(())
                .unwrap()
                .into_parts();
            parts
        };
        let headers = [http::HeaderName::from_static("x-currency")];
        let fp = |parts: &Parts, body: &[u8]| fingerprint(parts, &headers, body).unwrap();
        let base = fp(&request("POST", "/orders", "EUR"), br#"{"a":1,"b":2}"#);
        assert_eq!(
            base,
            fp(
                &request("POST", "/orders", "EUR"),
                b"{ \"b\": 2, \"a\": 1 }"
            )
        );
        assert_ne!(
            base,
            fp(&request("PATCH", "/orders", "EUR"), br#"{"a":1,"b":2}"#)
        );
        assert_ne!(
            base,
            fp(&request("POST", "/orders?x=1", "EUR"), br#"{"a":1,"b":2}"#)
        );
        assert_ne!(
            base,
            fp(&request("POST", "/orders", "USD"), br#"{"a":1,"b":2}"#)
        );
        assert_ne!(
            base,
            fp(&request("POST", "/orders", "EUR"), br#"{"a":1,"b":3}"#)
        );
        assert!(matches!(
            fingerprint(&request("POST", "/orders", "EUR"), &headers, b"not json"),
            Err(IdempotencyRejection::BodyNotJson(_))
        ));
    }
}
