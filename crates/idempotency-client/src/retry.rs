//! The retry rules: which answers are final, which are retried, and when (see the crate
//! documentation for the table and the reasons).

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, Method, StatusCode};
use idempotency_wire::{header::RETRY_AFTER_MS, ProblemType};
use reqwest::{Response, ResponseBuilderExt};
use std::time::{Duration, SystemTime};

/// The largest answer body read to learn a 409's or 422's problem type.
pub(crate) const INSPECT_LIMIT: u64 = 64 * 1024;

/// What to do after one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterAttempt {
    /// Give this answer back.
    Final,
    /// The 422 `key-reused`: the typed error.
    KeyReused,
    /// Send again: the request never reached the server.
    Retry,
    /// Send again if the request may be resent (keyed, or of an idempotent method): the server
    /// may have seen it.
    RetryIfResendable,
}

/// Whether a method is idempotent by its definition (RFC 9110 §9.2.2), so that resending it
/// needs no key.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// The server's retry hint: `Retry-After-Ms` (milliseconds) if present and valid, else
/// `Retry-After` as delay-seconds or an HTTP-date.
///
/// ```
/// # use http::{HeaderMap, HeaderValue};
/// # use std::time::Duration;
/// let mut headers = HeaderMap::new();
/// headers.insert("retry-after", HeaderValue::from_static("1"));
/// assert_eq!(idempotency_client::retry_hint(&headers), Some(Duration::from_secs(1)));
/// headers.insert("retry-after-ms", HeaderValue::from_static("40"));
/// assert_eq!(idempotency_client::retry_hint(&headers), Some(Duration::from_millis(40)));
/// ```
pub fn hint(headers: &HeaderMap) -> Option<Duration> {
    let text = |name: HeaderName| headers.get(name)?.to_str().ok().map(str::trim);
    if let Some(millis) = text(RETRY_AFTER_MS).and_then(|v| v.parse::<u64>().ok()) {
        return Some(Duration::from_millis(millis));
    }
    let value = text(header::RETRY_AFTER)?;
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(SystemTime::now()).unwrap_or_default())
}

/// The rules, for an answer; `problem` is the layer's problem type, where the answer is one of
/// its problem documents (under the middleware's base).
pub(crate) fn classify(
    status: StatusCode,
    replayed: bool,
    retry_after: Option<Duration>,
    problem: Option<ProblemType>,
) -> AfterAttempt {
    if replayed {
        // The server's stored answer: every retry would replay it again.
        return AfterAttempt::Final;
    }
    match status.as_u16() {
        408 => AfterAttempt::RetryIfResendable,
        409 => match problem {
            Some(ProblemType::InProgress | ProblemType::LeaseLost) => {
                AfterAttempt::RetryIfResendable
            }
            Some(ProblemType::NeedsReview) => AfterAttempt::Final,
            _ if retry_after.is_some() => AfterAttempt::RetryIfResendable,
            _ => AfterAttempt::Final,
        },
        422 if problem == Some(ProblemType::KeyReused) => AfterAttempt::KeyReused,
        429 | 500 if retry_after.is_some() => AfterAttempt::RetryIfResendable,
        502..=504 => AfterAttempt::RetryIfResendable,
        _ => AfterAttempt::Final,
    }
}

/// An answer, with its problem document read where the rules need it (409, 422): the body is
/// read then and the response rebuilt around it.
pub(crate) struct Inspected {
    response: Response,
    problem: Option<serde_json::Value>,
    body: Option<Bytes>,
}

impl Inspected {
    /// Reads a 409's or 422's JSON body (up to [`INSPECT_LIMIT`]); passes the others untouched.
    pub(crate) async fn read(response: Response) -> Result<Self, reqwest::Error> {
        let inspect = matches!(response.status().as_u16(), 409 | 422)
            && is_json(response.headers())
            && response
                .content_length()
                .is_none_or(|length| length <= INSPECT_LIMIT);
        if !inspect {
            return Ok(Self {
                response,
                problem: None,
                body: None,
            });
        }
        let status = response.status();
        let version = response.version();
        let url = response.url().clone();
        let headers = response.headers().clone();
        let mut response = response;
        let extensions = std::mem::take(response.extensions_mut());
        let body = response.bytes().await?;
        let problem = serde_json::from_slice::<serde_json::Value>(&body).ok();
        let mut builder = http::Response::builder()
            .status(status)
            .version(version)
            .url(url);
        if let Some(slot) = builder.headers_mut() {
            *slot = headers;
        }
        let mut rebuilt: Response = builder
            .body(body.clone())
            .expect("the parts of a received response are valid")
            .into();
        *rebuilt.extensions_mut() = extensions;
        Ok(Self {
            response: rebuilt,
            problem,
            body: Some(body),
        })
    }

    /// The problem `type`, where the body was read and has one.
    pub(crate) fn problem_type(&self) -> Option<&str> {
        self.problem.as_ref()?.get("type")?.as_str()
    }

    /// The problem's `detail`, else the body as text.
    pub(crate) fn detail(&self) -> String {
        let detail = self
            .problem
            .as_ref()
            .and_then(|p| p.get("detail"))
            .and_then(|d| d.as_str());
        match (detail, &self.body) {
            (Some(detail), _) => detail.to_owned(),
            (None, Some(body)) => String::from_utf8_lossy(body).into_owned(),
            (None, None) => String::new(),
        }
    }

    pub(crate) fn into_response(self) -> Response {
        self.response
    }
}

/// `application/json`, `application/problem+json` or another `+json` type.
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .is_some_and(|essence| essence == "application/json" || essence.ends_with("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn after(status: u16, problem: Option<ProblemType>, hint: Option<u64>) -> AfterAttempt {
        classify(
            StatusCode::from_u16(status).unwrap(),
            false,
            hint.map(Duration::from_millis),
            problem,
        )
    }

    #[test]
    fn the_rules() {
        use AfterAttempt::*;
        for status in [200, 201, 204, 301, 400, 401, 403, 404, 405, 410, 413, 415] {
            assert_eq!(after(status, None, None), Final, "{status}");
            assert_eq!(after(status, None, Some(10)), Final, "{status} with a hint");
        }
        assert_eq!(after(422, None, Some(10)), Final);
        // 422 of the application's own (not one of the layer's problem types): final.
        assert_eq!(after(422, None, None), Final);
        assert_eq!(after(422, Some(ProblemType::KeyReused), None), KeyReused);
        assert_eq!(
            after(409, Some(ProblemType::InProgress), None),
            RetryIfResendable
        );
        assert_eq!(
            after(409, Some(ProblemType::LeaseLost), None),
            RetryIfResendable
        );
        assert_eq!(after(409, Some(ProblemType::NeedsReview), Some(5)), Final);
        // The application's own 409 (a duplicate e-mail): final without a hint.
        assert_eq!(after(409, None, None), Final);
        assert_eq!(after(409, None, Some(5)), RetryIfResendable);
        assert_eq!(after(500, None, None), Final);
        assert_eq!(after(500, None, Some(1000)), RetryIfResendable);
        assert_eq!(after(429, None, None), Final);
        assert_eq!(after(429, None, Some(1000)), RetryIfResendable);
        for status in [502, 503, 504, 408] {
            assert_eq!(after(status, None, None), RetryIfResendable, "{status}");
        }
        assert_eq!(after(501, None, None), Final);
        let replayed_502 = classify(StatusCode::BAD_GATEWAY, true, None, None);
        assert_eq!(replayed_502, Final);
    }

    #[test]
    fn hints() {
        let mut headers = HeaderMap::new();
        assert_eq!(hint(&headers), None);
        headers.insert("retry-after", "garbage".parse().unwrap());
        assert_eq!(hint(&headers), None);
        let soon = SystemTime::now() + Duration::from_secs(120);
        headers.insert(
            "retry-after",
            httpdate::fmt_http_date(soon).parse().unwrap(),
        );
        let from_date = hint(&headers).unwrap();
        assert!(from_date > Duration::from_secs(100) && from_date <= Duration::from_secs(120));
        headers.insert("retry-after-ms", "not a number".parse().unwrap());
        assert!(hint(&headers).unwrap() > Duration::from_secs(100));
        headers.insert("retry-after-ms", "7".parse().unwrap());
        assert_eq!(hint(&headers), Some(Duration::from_millis(7)));
    }

    #[test]
    fn recognises_json() {
        let mut headers = HeaderMap::new();
        assert!(!is_json(&headers));
        for (value, json) in [
            ("application/json", true),
            ("application/problem+json", true),
            ("Application/Problem+JSON; charset=utf-8", true),
            ("text/plain", false),
        ] {
            headers.insert(header::CONTENT_TYPE, value.parse().unwrap());
            assert_eq!(is_json(&headers), json, "{value}");
        }
    }
}
