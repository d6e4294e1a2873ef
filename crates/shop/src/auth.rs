//! Demo authentication: `X-User-Id` names the user ([`UserId`]).

use crate::problem::{Problem, ShopProblem};
use axum::{
    extract::Request,
    http::StatusCode,
    middleware::Next,
    response::{IntoResponse, Response},
};

/// The demo authentication header.
pub const USER_HEADER: &str = "x-user-id";

/// The authenticated user (demo: taken from `X-User-Id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserId(pub String);

/// 401 for a request without a valid `X-User-Id`.
pub fn unauthenticated() -> Problem {
    Problem::shop(
        StatusCode::UNAUTHORIZED,
        "unauthenticated",
        "Authentication required",
        "send X-User-Id: <id> (1 to 64 characters of A-Z a-z 0-9 _ -)",
    )
}

/// Demo authentication: `X-User-Id` names the user.
pub async fn authenticate(mut request: Request, next: Next) -> Response {
    let user = request
        .headers()
        .get(USER_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|id| {
            !id.is_empty()
                && id.len() <= 64
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        })
        .map(|id| UserId(id.to_owned()));
    match user {
        Some(user) => {
            request.extensions_mut().insert(user);
            next.run(request).await
        }
        None => unauthenticated().into_response(),
    }
}
