//! Who may use the console: the password (or bearer token), the sessions it opens, and the
//! CSRF token bound to each session.
//!
//! Every request passes [`require`]: without a valid session cookie or `Authorization: Bearer`
//! it answers 401 (a GET gets the sign-in page). A POST signed in by cookie must carry the
//! session's token in its `csrf` field, or it answers 403; a bearer request carries no ambient
//! credential, so it needs none.

use super::{form::Fields, layout};
use axum::{
    body::{to_bytes, Body},
    extract::{Request, State},
    http::{header, HeaderMap, Method, StatusCode},
    middleware::Next,
    response::{IntoResponse, Redirect, Response},
};
use rand::RngCore;
use sha2::{Digest, Sha256};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use subtle::ConstantTimeEq;

/// The session cookie's name.
pub const COOKIE: &str = "idem_console";
/// How long a session lasts after sign-in.
pub const SESSION_LENGTH: Duration = Duration::from_secs(12 * 3600);
/// How long a wrong password's answer waits.
const WRONG_PASSWORD_PAUSE: Duration = Duration::from_millis(500);
/// The largest form body read (a bulk confirmation of 100 keys fits many times).
const MAX_FORM: usize = 1 << 20;

/// The secret and the open sessions.
pub struct Sessions {
    secret: [u8; 32],
    open: Mutex<HashMap<String, Session>>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions").finish_non_exhaustive()
    }
}

/// One signed-in browser: its CSRF token and when it ends.
#[derive(Debug, Clone)]
struct Session {
    csrf: String,
    ends: Instant,
}

/// Who made a request, as the handlers see it (a request extension).
#[derive(Debug, Clone)]
pub struct Signed {
    /// The CSRF token to put in the page's forms (empty for a bearer request).
    pub csrf: String,
}

fn digest(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

fn random_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    hex::encode(bytes)
}

impl Sessions {
    /// No session yet; `secret` signs in.
    pub fn new(secret: &str) -> Self {
        Self {
            secret: digest(secret),
            open: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `given` is the secret, in time independent of where they differ (both are
    /// hashed first, so the length does not show either).
    pub fn is_secret(&self, given: &str) -> bool {
        digest(given).ct_eq(&self.secret).into()
    }

    /// Opens a session; returns its cookie value.
    fn open(&self) -> String {
        let token = random_token();
        let session = Session {
            csrf: random_token(),
            ends: Instant::now() + SESSION_LENGTH,
        };
        let mut open = self.open.lock().expect("sessions lock");
        let now = Instant::now();
        open.retain(|_, s| s.ends > now);
        open.insert(token.clone(), session);
        token
    }

    fn find(&self, token: &str) -> Option<Session> {
        let open = self.open.lock().expect("sessions lock");
        open.get(token).filter(|s| s.ends > Instant::now()).cloned()
    }

    fn close(&self, token: &str) {
        self.open.lock().expect("sessions lock").remove(token);
    }
}

/// The session cookie's value in `headers`, if any.
fn cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value)
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

/// The gate in front of every route but `POST /sign-in`: 401 without a credential, 403 for a
/// cookie-signed POST without its session's CSRF token. Passes the handler a [`Signed`] and, for
/// a POST, the form's [`Fields`].
pub async fn require(
    State(sessions): State<Arc<Sessions>>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() == Method::POST && request.uri().path() == "/sign-in" {
        return next.run(request).await;
    }
    let headers = request.headers();
    let (signed, csrf) = if bearer(headers).is_some_and(|b| sessions.is_secret(b)) {
        (
            Signed {
                csrf: String::new(),
            },
            None,
        )
    } else if let Some(session) = cookie(headers).and_then(|t| sessions.find(t)) {
        let csrf = session.csrf.clone();
        (Signed { csrf: session.csrf }, Some(csrf))
    } else {
        return layout::sign_in(StatusCode::UNAUTHORIZED, None);
    };
    let (mut parts, body) = request.into_parts();
    let mut request = if parts.method == Method::POST {
        let Ok(bytes) = to_bytes(body, MAX_FORM).await else {
            return layout::problem(StatusCode::PAYLOAD_TOO_LARGE, "The form is too large.");
        };
        let fields = Fields::parse(&bytes);
        if let Some(expected) = csrf {
            let given = fields.get("csrf").unwrap_or("");
            if !bool::from(given.as_bytes().ct_eq(expected.as_bytes())) {
                return layout::problem(
                    StatusCode::FORBIDDEN,
                    "This form has no valid CSRF token: reload the page and try again.",
                );
            }
        }
        parts.extensions.insert(fields);
        Request::from_parts(parts, Body::from(bytes))
    } else {
        Request::from_parts(parts, body)
    };
    request.extensions_mut().insert(signed);
    next.run(request).await
}

/// `POST /sign-in`: the right password opens a session (HttpOnly, SameSite=Strict cookie) and
/// goes to the overview; a wrong one answers 401 with the form again.
pub async fn sign_in(State(sessions): State<Arc<Sessions>>, body: axum::body::Bytes) -> Response {
    let fields = Fields::parse(&body);
    if !sessions.is_secret(fields.get("password").unwrap_or("")) {
        // Slows down guessing (one guess per connection per pause).
        tokio::time::sleep(WRONG_PASSWORD_PAUSE).await;
        return layout::sign_in(StatusCode::UNAUTHORIZED, Some("Wrong password."));
    }
    let token = sessions.open();
    let cookie = format!(
        "{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}",
        SESSION_LENGTH.as_secs()
    );
    ([(header::SET_COOKIE, cookie)], Redirect::to("/")).into_response()
}

/// `POST /sign-out` (behind [`require`]): closes the session and shows the sign-in page.
pub async fn sign_out(State(sessions): State<Arc<Sessions>>, headers: HeaderMap) -> Response {
    if let Some(token) = cookie(&headers) {
        sessions.close(token);
    }
    let expired = format!("{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0");
    ([(header::SET_COOKIE, expired)], Redirect::to("/")).into_response()
}

#[cfg(test)]
mod tests {
    use super::{cookie, Sessions};
    use axum::http::{header, HeaderMap, HeaderValue};

    #[test]
    fn the_secret_and_sessions() {
        let sessions = Sessions::new("s3cret");
        assert!(sessions.is_secret("s3cret"));
        assert!(!sessions.is_secret("s3cret "));
        assert!(!sessions.is_secret(""));
        let token = sessions.open();
        assert_eq!(token.len(), 64);
        let session = sessions.find(&token).expect("open");
        assert_ne!(session.csrf, token);
        assert!(sessions.find("other").is_none());
        sessions.close(&token);
        assert!(sessions.find(&token).is_none());
    }

    #[test]
    fn finds_the_cookie_among_others() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; idem_console=abc; b=2"),
        );
        assert_eq!(cookie(&headers), Some("abc"));
        assert_eq!(cookie(&HeaderMap::new()), None);
    }
}
