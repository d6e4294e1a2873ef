//! Starts the real `shop` binary on a free port and talks to it.
#![allow(dead_code)]

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};
use test_support::TestDatabase;

/// A running `shop` process, killed on drop.
pub struct Shop {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    _sqlite: Option<test_support::SqliteFile>,
}

impl Drop for Shop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh database of `backend` (its URL and, for SQLite, its file); `None` when skipped.
pub async fn database(backend: TestDatabase) -> Option<(String, Option<test_support::SqliteFile>)> {
    let database = backend.fresh_database().await?;
    Some((database.url, database.sqlite))
}

/// Starts `shop --listen 127.0.0.1:0 --database-url URL EXTRA…` and waits for its address.
pub fn start(url: &str, sqlite: Option<test_support::SqliteFile>, extra: &[&str]) -> Shop {
    let mut child = Command::new(env!("CARGO_BIN_EXE_shop"))
        .args(["--listen", "127.0.0.1:0", "--database-url", url])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the shop binary");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        while let Some(Ok(line)) = lines.next() {
            if let Some(url) = shop::storm::listening_url(&line) {
                let _ = tx.send(url);
            }
        }
    });
    let url = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the shop printed where it listens");
    Shop {
        child,
        url,
        _sqlite: sqlite,
    }
}

/// A shop on a fresh database of `backend`, for one scenario; `None` when skipped.
pub async fn fresh_shop(backend: TestDatabase) -> Option<Shop> {
    let (url, sqlite) = database(backend).await?;
    Some(start(&url, sqlite, &[]))
}

/// The fixture of the scenarios of `test_support::backend_tests!`: a shop of its own.
impl test_support::Fixture for Shop {
    async fn open(backend: TestDatabase) -> Option<Self> {
        fresh_shop(backend).await
    }
}

/// One answer: status, content type, replay header, JSON body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub content_type: String,
    pub replayed: bool,
    pub body: serde_json::Value,
}

impl Reply {
    /// Asserts a problem document with this status and `type`.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.content_type, "application/problem+json", "{self:?}");
        // The shop's own problems and the middleware's share one base.
        let type_uri = self.body["type"].as_str().unwrap_or_default();
        assert!(
            type_uri == format!("{}{slug}", shop::problem::TYPE_BASE)
                || type_uri == format!("{}{slug}", idempotency_http::wire::DEFAULT_PROBLEM_BASE),
            "type {slug}: {self:?}"
        );
        assert_eq!(self.body["status"], status, "{self:?}");
        assert!(
            self.body["detail"].as_str().is_some_and(|d| d.len() > 10),
            "a clear message: {self:?}"
        );
    }
}

/// Sends a request; `body` is sent raw with `Content-Type: application/json` when given.
pub async fn send(
    method: &str,
    url: &str,
    user: Option<&str>,
    key: Option<&str>,
    body: Option<&str>,
) -> Reply {
    let client = reqwest::Client::new();
    let mut request = client.request(method.parse().unwrap(), url);
    if let Some(user) = user {
        request = request.header("x-user-id", user);
    }
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body.to_owned());
    }
    let response = request.send().await.expect("request");
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let replayed = response.headers().get("idempotent-replayed").is_some();
    let text = response.text().await.expect("body");
    Reply {
        status,
        content_type,
        replayed,
        body: serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
    }
}
