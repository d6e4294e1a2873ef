//! `idem console`: the review console, a small web server over the key table.
//!
//! Server-rendered HTML (no scripts, no outside assets); every answer carries a strict
//! Content-Security-Policy, `X-Content-Type-Options: nosniff` and `Cache-Control: no-store`.
//! It listens on 127.0.0.1 unless told otherwise, needs a password (from the environment or a
//! file) for every request, protects every form with a CSRF token, and only reads unless
//! started with `--allow-actions`.

mod actions;
mod app;
mod auth;
mod form;
mod layout;
mod links;
mod pages;
mod redact;

use anyhow::{bail, Context, Result};
use app::{App, Settings};
use auth::Sessions;
use axum::{
    http::{header, HeaderValue},
    middleware::{from_fn_with_state, map_response},
    response::Response,
    routing::{get, post},
    Router,
};
use clap::Args;
use idempotency::store::Maintenance;
use std::{future::Future, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

/// The environment variable holding the console's password.
pub const PASSWORD_ENV: &str = "IDEM_CONSOLE_PASSWORD";

/// The Content-Security-Policy of every answer.
pub const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'";

/// `idem console`'s options.
#[derive(Debug, Args)]
pub struct ConsoleArgs {
    /// Address to listen on (port 0 picks a free one; the address is printed).
    #[arg(long, default_value = "127.0.0.1:7878", value_name = "ADDR")]
    listen: SocketAddr,
    /// Show action forms and accept actions (resolve, hand back, bulk); read-only without it.
    #[arg(long)]
    allow_actions: bool,
    /// Read the password from this file (first line) instead of IDEM_CONSOLE_PASSWORD.
    #[arg(long, value_name = "FILE")]
    password_file: Option<PathBuf>,
    /// JSON field names masked in stored requests and journals (repeatable; replaces the
    /// default list: password, card, card_number, cvc, token, secret, authorization).
    #[arg(long, value_name = "FIELD", num_args = 1..)]
    redact: Vec<String>,
    /// How long a key resolved from the console is kept.
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration, value_name = "DURATION")]
    retention: Duration,
}

impl ConsoleArgs {
    /// The password: the file's first line, or the environment's; refused when missing or empty.
    pub fn secret(&self) -> Result<String> {
        let secret = match &self.password_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| {
                    format!("could not read the password file {}", path.display())
                })?;
                text.lines().next().unwrap_or("").to_owned()
            }
            None => std::env::var(PASSWORD_ENV).unwrap_or_default(),
        };
        if secret.is_empty() {
            bail!(
                "the console needs a password: set {PASSWORD_ENV} or pass --password-file FILE \
                 (never on the command line)"
            );
        }
        Ok(secret)
    }

    fn settings(&self) -> Settings {
        let redact = if self.redact.is_empty() {
            redact::DEFAULT_FIELDS
                .iter()
                .map(|f| f.to_string())
                .collect()
        } else {
            self.redact.clone()
        };
        Settings {
            allow_actions: self.allow_actions,
            redact,
            retention: self.retention,
        }
    }
}

/// The console's routes, behind the credential check and the security headers.
fn router<S: Maintenance>(app: App<S>) -> Router {
    let sessions = Arc::clone(&app.sessions);
    Router::new()
        .route("/", get(pages::overview::<S>))
        .route("/keys", get(pages::keys::<S>))
        .route("/past-lease", get(pages::past_lease::<S>))
        .route("/key", get(pages::key::<S>))
        .route("/key/resolve", post(actions::resolve::<S>))
        .route("/key/hand-back", post(actions::hand_back::<S>))
        .route("/keys/bulk", post(actions::bulk_preview::<S>))
        .route("/keys/bulk/confirm", post(actions::bulk_confirm::<S>))
        .route("/sign-in", post(auth::sign_in))
        .route("/sign-out", post(auth::sign_out))
        .route("/style.css", get(layout::stylesheet))
        .fallback(not_found)
        .with_state(app)
        .layer(from_fn_with_state(sessions, auth::require))
        .layer(map_response(security_headers))
}

async fn not_found() -> Response {
    layout::problem(axum::http::StatusCode::NOT_FOUND, "There is no such page.")
}

/// The headers every answer carries.
async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

/// Serves the console over `store` until `shutdown` completes. Prints
/// `idem console: listening on http://ADDR` once listening.
pub async fn serve<S: Maintenance>(
    store: S,
    args: ConsoleArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let app = App {
        store,
        settings: Arc::new(args.settings()),
        sessions: Arc::new(Sessions::new(&args.secret()?)),
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("could not listen on {}", args.listen))?;
    let address = listener.local_addr()?;
    println!("idem console: listening on http://{address}");
    if !address.ip().is_loopback() {
        eprintln!(
            "warning: the console listens beyond this machine on {address}, over plain HTTP: \
             put it behind TLS"
        );
    }
    if !args.allow_actions {
        eprintln!("read-only: start with --allow-actions to resolve or hand back keys");
    }
    axum::serve(listener, router(app))
        .with_graceful_shutdown(shutdown)
        .await
        .context("the console stopped")
}
