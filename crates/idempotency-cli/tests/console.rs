//! `idem console` over HTTP: the real binary on SQLite, PostgreSQL and MariaDB, driven with
//! reqwest. Credentials (401), CSRF (403), read-only mode, filters, resolving with a reason,
//! the refusal of stale pages (409), keyset paging and bulk actions after a preview.

use idempotency::{
    store::{Insertion, Journal, KeyState, LeaseToken, PendingRow, Progress},
    Effects, Fingerprint, IdempotencyKey, MySqlStore, PgStore, SqliteStore, Store,
};
use reqwest::{header, redirect, Client, StatusCode};
use std::{process::Stdio, time::Duration};
use test_support::{Database, Fixture, TestDatabase};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
};

const PASSWORD: &str = "correct horse battery staple";

/// A store of any backend, for seeding and checking rows.
#[derive(Clone)]
enum AnyStore {
    Postgres(PgStore),
    Sqlite(SqliteStore),
    MySql(MySqlStore),
}

macro_rules! with_store {
    ($any:expr, $s:ident => $body:expr) => {
        match $any {
            AnyStore::Postgres($s) => $body,
            AnyStore::Sqlite($s) => $body,
            AnyStore::MySql($s) => $body,
        }
    };
}

/// A migrated database with two consoles on it: one allowing actions, one read-only.
struct Consoles {
    store: AnyStore,
    actions: Running,
    read_only: Running,
    http: Client,
    _database: Database,
}

/// One `idem console` process (killed when dropped) and its address.
struct Running {
    base: String,
    _child: Child,
}

async fn start(url: &str, allow_actions: bool) -> Running {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    command
        .env_remove("DATABASE_URL")
        .env("IDEM_CONSOLE_PASSWORD", PASSWORD)
        .args(["--database-url", url, "console", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    if allow_actions {
        command.arg("--allow-actions");
    }
    let mut child = command.spawn().expect("start idem console");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
        .await
        .expect("the console prints its address")
        .expect("read stdout")
        .expect("a line");
    let base = line
        .strip_prefix("idem console: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    assert!(
        base.starts_with("http://127.0.0.1:") && !base.ends_with(":0"),
        "{base}"
    );
    // Keep reading stdout so the process never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Running {
        base,
        _child: child,
    }
}

impl Fixture for Consoles {
    async fn open(backend: TestDatabase) -> Option<Self> {
        let database = backend.fresh_database().await?;
        let store = match backend {
            TestDatabase::Sqlite => {
                AnyStore::Sqlite(SqliteStore::connect(&database.url).await.ok()?)
            }
            TestDatabase::Postgres => {
                AnyStore::Postgres(PgStore::connect(&database.url).await.ok()?)
            }
            TestDatabase::MySql => AnyStore::MySql(MySqlStore::connect(&database.url).await.ok()?),
        };
        with_store!(&store, s => s.migrate().await.expect("migrate"));
        let actions = start(&database.url, true).await;
        let read_only = start(&database.url, false).await;
        let http = Client::builder()
            .redirect(redirect::Policy::none())
            .timeout(Duration::from_secs(60))
            .build()
            .expect("client");
        Some(Consoles {
            store,
            actions,
            read_only,
            http,
            _database: database,
        })
    }
}

/// A key parked for review, with a stored request holding a card number and a journal with
/// one outside step.
async fn park<S: Journal>(store: &S, key: &IdempotencyKey) {
    let token = LeaseToken::new();
    let row = PendingRow {
        key,
        fingerprint: Fingerprint::of_bytes(key.key().as_bytes()),
        token,
        effects: Effects::External,
        journaled: true,
        lease: Duration::from_secs(3600),
        retention: Duration::from_secs(3600),
    };
    assert_eq!(
        store.insert_pending(&row).await.unwrap(),
        Insertion::Inserted
    );
    let mut tx = store.begin().await.unwrap();
    let progress = Progress {
        recovery_point: "charge",
        journal: br#"{"done":{"reserve-stock":{"held":1}},"started":["charge"]}"#,
        request: Some(br#"{"sku":"tea","card_number":"4242424242424242","nested":{"cvc":"123"}}"#),
    };
    assert!(store
        .save_progress(&mut tx, key, token, &progress)
        .await
        .unwrap());
    tx.commit().await.unwrap();
    assert!(store
        .park(key, token, "the provider did not answer")
        .await
        .unwrap());
}

/// A page's HTML with `&quot;` and friends decoded (enough for attribute values).
fn unescape(text: &str) -> String {
    text.replace("&quot;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

/// The `value` of every input named `name`, in page order.
fn values(html: &str, name: &str) -> Vec<String> {
    let needle = format!("name=\"{name}\" value=\"");
    html.match_indices(&needle)
        .map(|(at, _)| {
            let rest = &html[at + needle.len()..];
            unescape(&rest[..rest.find('"').expect("closing quote")])
        })
        .collect()
}

fn value(html: &str, name: &str) -> String {
    values(html, name)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no input {name} in {html}"))
}

/// The text of the element with `id` (up to its first `<`).
fn text_of(html: &str, id: &str) -> String {
    let needle = format!("id=\"{id}\"");
    let at = html
        .find(&needle)
        .unwrap_or_else(|| panic!("no #{id} in {html}"));
    let rest = &html[at..];
    let start = rest.find('>').unwrap() + 1;
    let end = rest[start..].find('<').unwrap() + start;
    unescape(&rest[start..end])
}

fn key_query(key: &IdempotencyKey) -> [(&'static str, &str); 3] {
    [
        ("scope", key.scope()),
        ("operation", key.operation()),
        ("key", key.key()),
    ]
}

/// A signed-in browser on one console.
struct Browser<'a> {
    http: &'a Client,
    base: &'a str,
    cookie: String,
}

impl Consoles {
    async fn find(&self, key: &IdempotencyKey) -> idempotency::store::KeyRecord {
        with_store!(&self.store, s => s.find(key).await.unwrap().expect("the key exists"))
    }

    async fn park(&self, key: &IdempotencyKey) {
        with_store!(&self.store, s => park(s, key).await)
    }

    async fn sign_in<'a>(&'a self, console: &'a Running) -> Browser<'a> {
        let answer = self
            .http
            .post(format!("{}/sign-in", console.base))
            .form(&[("password", PASSWORD)])
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::SEE_OTHER);
        assert_eq!(answer.headers()[header::LOCATION], "/");
        let set = answer.headers()[header::SET_COOKIE]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(
            set.contains("HttpOnly") && set.contains("SameSite=Strict"),
            "{set}"
        );
        Browser {
            http: &self.http,
            base: &console.base,
            cookie: set.split(';').next().unwrap().to_owned(),
        }
    }
}

impl Browser<'_> {
    async fn get(&self, path_and_query: &str) -> (StatusCode, String) {
        let answer = self
            .http
            .get(format!("{}{path_and_query}", self.base))
            .header(header::COOKIE, &self.cookie)
            .send()
            .await
            .unwrap();
        (answer.status(), answer.text().await.unwrap())
    }

    async fn key_page(&self, key: &IdempotencyKey) -> String {
        let query = serde_urlencoded::to_string(key_query(key)).unwrap();
        let (status, html) = self.get(&format!("/key?{query}")).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        html
    }

    async fn post(&self, path: &str, form: &[(&str, &str)]) -> reqwest::Response {
        self.http
            .post(format!("{}{path}", self.base))
            .header(header::COOKIE, &self.cookie)
            .form(form)
            .send()
            .await
            .unwrap()
    }
}

/// The form fields of a resolve (or hand-back) post for the page `html` of `key`.
fn action_form<'a>(html: &'a str, key: &'a IdempotencyKey) -> Vec<(&'static str, String)> {
    vec![
        ("csrf", value(html, "csrf")),
        ("scope", key.scope().to_owned()),
        ("operation", key.operation().to_owned()),
        ("key", key.key().to_owned()),
        ("seen", value(html, "seen")),
        ("operator", "ada".to_owned()),
    ]
}

fn with<'a>(
    base: &'a [(&'static str, String)],
    more: &[(&'static str, &'a str)],
) -> Vec<(&'static str, String)> {
    let mut form = base.to_vec();
    form.extend(more.iter().map(|(n, v)| (*n, v.to_string())));
    form
}

fn pairs<'a>(form: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    form.iter().map(|(n, v)| (*n, v.as_str())).collect()
}

fn key(operation: &str, name: &str) -> IdempotencyKey {
    IdempotencyKey::new("user-7", operation, name).unwrap()
}

/// Without a session or the bearer secret, every path answers 401 (GETs with the sign-in
/// form); a wrong password too. The bearer secret opens every page. Every answer carries the
/// CSP, nosniff and no-store.
async fn every_page_needs_a_credential(consoles: Consoles) {
    let parked = key("mail", "k-401");
    consoles.park(&parked).await;
    let query = serde_urlencoded::to_string(key_query(&parked)).unwrap();
    let http = &consoles.http;
    let base = &consoles.actions.base;
    for path in [
        "/",
        "/keys",
        "/keys?state=needs_review",
        "/past-lease",
        &format!("/key?{query}"),
        "/style.css",
        "/no-such-page",
        "/sign-in",
    ] {
        let answer = http.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "GET {path}");
        let headers = answer.headers().clone();
        assert_eq!(
            headers[header::CONTENT_SECURITY_POLICY],
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'"
        );
        assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert_eq!(headers[header::CACHE_CONTROL], "no-store");
        let html = answer.text().await.unwrap();
        assert!(
            html.contains(r#"<form id="sign-in" method="post" action="/sign-in">"#),
            "{html}"
        );
        assert!(
            !html.contains("k-401"),
            "GET {path} shows nothing of the keys"
        );
    }
    for path in [
        "/key/resolve",
        "/key/hand-back",
        "/keys/bulk",
        "/keys/bulk/confirm",
        "/sign-out",
    ] {
        let answer = http
            .post(format!("{base}{path}"))
            .form(&[
                ("scope", "user-7"),
                ("operation", "mail"),
                ("key", "k-401"),
                ("resolution", "failed"),
                ("reason", "r"),
                ("operator", "o"),
            ])
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "POST {path}");
    }
    let wrong = http
        .post(format!("{base}/sign-in"))
        .form(&[("password", "guess")])
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    assert!(wrong.headers().get(header::SET_COOKIE).is_none());
    let forged = http
        .get(format!("{base}/"))
        .header(header::COOKIE, "idem_console=00ff")
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), StatusCode::UNAUTHORIZED);
    let bearer = http
        .get(format!("{base}/"))
        .bearer_auth(PASSWORD)
        .send()
        .await
        .unwrap();
    assert_eq!(bearer.status(), StatusCode::OK);
    assert!(bearer
        .text()
        .await
        .unwrap()
        .contains(r#"<table id="counts">"#));
    let bad_bearer = http
        .get(format!("{base}/"))
        .bearer_auth("guess")
        .send()
        .await
        .unwrap();
    assert_eq!(bad_bearer.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(consoles.find(&parked).await.state, KeyState::NeedsReview);
}

/// A signed-in POST without its session's CSRF token (or with another's) answers 403 and
/// writes nothing.
async fn posts_without_the_csrf_token_are_refused(consoles: Consoles) {
    let parked = key("mail", "k-403");
    consoles.park(&parked).await;
    let browser = consoles.sign_in(&consoles.actions).await;
    let other = consoles.sign_in(&consoles.actions).await;
    let html = browser.key_page(&parked).await;
    let form = with(
        &action_form(&html, &parked),
        &[("resolution", "failed"), ("reason", "no charge")],
    );
    let without: Vec<_> = pairs(&form)
        .into_iter()
        .filter(|(n, _)| *n != "csrf")
        .collect();
    assert_eq!(
        browser.post("/key/resolve", &without).await.status(),
        StatusCode::FORBIDDEN
    );
    let others_token = value(&other.key_page(&parked).await, "csrf");
    assert_ne!(others_token, value(&html, "csrf"), "one token per session");
    let mut forged = without.clone();
    forged.push(("csrf", &others_token));
    let answer = browser.post("/key/resolve", &forged).await;
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    assert!(answer.text().await.unwrap().contains(r#"id="problem""#));
    assert_eq!(
        browser
            .post("/keys/bulk", &[("action", "failed")])
            .await
            .status(),
        StatusCode::FORBIDDEN
    );
    assert_eq!(consoles.find(&parked).await.state, KeyState::NeedsReview);
    // With the right token it goes through.
    let answer = browser.post("/key/resolve", &pairs(&form)).await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(consoles.find(&parked).await.state, KeyState::Failed);
    // Signing out needs the token too, and ends the session.
    assert_eq!(
        browser.post("/sign-out", &[]).await.status(),
        StatusCode::FORBIDDEN
    );
    let token = value(&browser.get("/").await.1, "csrf");
    assert_eq!(
        browser
            .post("/sign-out", &[("csrf", &token)])
            .await
            .status(),
        StatusCode::SEE_OTHER
    );
    assert_eq!(browser.get("/").await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(
        other.get("/").await.0,
        StatusCode::OK,
        "other sessions go on"
    );
}

/// Without --allow-actions the key page has no action forms, and action posts (with a valid
/// token) answer 403 and write nothing.
async fn read_only_refuses_actions(consoles: Consoles) {
    let parked = key("mail", "k-ro");
    consoles.park(&parked).await;
    let browser = consoles.sign_in(&consoles.read_only).await;
    let html = browser.key_page(&parked).await;
    assert!(
        !html.contains(r#"id="resolve""#) && !html.contains(r#"id="hand-back""#),
        "{html}"
    );
    let csrf = value(&html, "csrf"); // the sign-out form's
    let seen = text_of(&html, "key-updated");
    let form = [
        ("csrf", csrf.as_str()),
        ("scope", "user-7"),
        ("operation", "mail"),
        ("key", "k-ro"),
        ("seen", &seen),
        ("resolution", "failed"),
        ("operator", "ada"),
        ("reason", "no charge"),
    ];
    for path in [
        "/key/resolve",
        "/key/hand-back",
        "/keys/bulk",
        "/keys/bulk/confirm",
    ] {
        assert_eq!(
            browser.post(path, &form).await.status(),
            StatusCode::FORBIDDEN,
            "{path}"
        );
    }
    let (_, list) = browser.get("/keys?state=needs_review").await;
    assert!(!list.contains(r#"id="bulk""#));
    assert_eq!(consoles.find(&parked).await.state, KeyState::NeedsReview);
}

/// Filter to needs_review, open a key (request masked, journal, provider keys), resolve it with
/// a reason; a reason is required; a second session's stale page is refused with 409 and
/// nothing is written.
async fn resolve_with_a_reason_and_refuse_stale_pages(consoles: Consoles) {
    let (first, second) = (key("mail", "k-1"), key("mail", "k-2"));
    consoles.park(&first).await;
    consoles.park(&second).await;
    with_store!(&consoles.store, s => {
        let row = PendingRow {
            key: &key("mail", "k-pending"),
            fingerprint: Fingerprint::of_bytes(b"p"),
            token: LeaseToken::new(),
            effects: Effects::Local,
            journaled: false,
            lease: Duration::from_secs(3600),
            retention: Duration::from_secs(3600),
        };
        s.insert_pending(&row).await.unwrap();
    });
    let ada = consoles.sign_in(&consoles.actions).await;
    let bob = consoles.sign_in(&consoles.actions).await;
    let (status, list) = ada
        .get("/keys?state=needs_review&operation=mail&scope=&older_than=")
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list.matches(r#"<tr class="key-row">"#).count(), 2, "{list}");
    assert!(list.contains("k-1") && list.contains("k-2") && !list.contains("k-pending"));
    let (_, all) = ada.get("/keys").await;
    assert_eq!(all.matches(r#"<tr class="key-row">"#).count(), 3);

    let page = ada.key_page(&first).await;
    assert_eq!(text_of(&page, "key-state"), "needs_review");
    let request = text_of(&page, "key-request");
    assert!(
        request.contains("\"sku\": \"tea\"")
            && !request.contains("4242")
            && !request.contains("123"),
        "{request}"
    );
    assert_eq!(request.matches("***").count(), 2);
    assert!(text_of(&page, "key-journal").contains("reserve-stock"));
    assert!(page.contains(&idempotency::durable::provider_key(&first, "charge")));
    let stale = bob.key_page(&first).await;

    let form = action_form(&page, &first);
    let no_reason = with(&form, &[("resolution", "failed"), ("reason", "  ")]);
    let answer = ada.post("/key/resolve", &pairs(&no_reason)).await;
    assert_eq!(answer.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(answer.text().await.unwrap().contains(r#"id="problem""#));
    let not_json = with(
        &form,
        &[
            ("resolution", "completed"),
            ("result", "{oops"),
            ("reason", "charged"),
        ],
    );
    assert_eq!(
        ada.post("/key/resolve", &pairs(&not_json)).await.status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(consoles.find(&first).await.state, KeyState::NeedsReview);

    let resolve = with(
        &form,
        &[
            ("resolution", "completed"),
            ("result", r#"{"order":7}"#),
            ("reason", "charged at the provider"),
            ("evidence", "ch_123"),
        ],
    );
    let answer = ada.post("/key/resolve", &pairs(&resolve)).await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let location = answer.headers()[header::LOCATION]
        .to_str()
        .unwrap()
        .to_owned();
    let (_, after) = ada.get(&location).await;
    assert_eq!(text_of(&after, "key-state"), "completed");
    assert!(after.contains(r#"id="flash""#));
    let resolved = event(&after, "resolved");
    assert!(
        resolved.contains("ada")
            && resolved.contains("charged at the provider")
            && resolved.contains("ch_123"),
        "{resolved}"
    );
    let row = consoles.find(&first).await;
    assert_eq!(row.state, KeyState::Completed);
    assert_eq!(row.result.as_deref(), Some(br#"{"order":7}"#.as_slice()));
    assert!(row
        .reason
        .as_deref()
        .unwrap()
        .contains("charged at the provider"));

    // Bob's page is stale: refused, nothing written.
    let stale_form = with(
        &action_form(&stale, &first),
        &[("resolution", "failed"), ("reason", "no charge")],
    );
    let answer = bob.post("/key/resolve", &pairs(&stale_form)).await;
    assert_eq!(answer.status(), StatusCode::CONFLICT);
    assert!(text_of(&answer.text().await.unwrap(), "problem").contains("changed meanwhile"));
    let unchanged = consoles.find(&first).await;
    assert_eq!(
        (unchanged.state, unchanged.updated_at),
        (KeyState::Completed, row.updated_at)
    );
    assert_eq!(unchanged.result, row.result);
    let (_, now) = ada.get(&location).await;
    assert_eq!(
        now.matches(r#"data-kind="resolved""#).count(),
        1,
        "no event for the refusal"
    );

    // A page of a key still parked, whose row changed since (parked anew after a hand-back by
    // another console), is stale too: the `seen` fence, not only the state.
    let second_page = ada.key_page(&second).await;
    let mut seen_earlier = action_form(&second_page, &second);
    for (name, value) in seen_earlier.iter_mut() {
        if *name == "seen" {
            *value = "2001-01-01T00:00:00.000000Z".into();
        }
    }
    let earlier = with(
        &seen_earlier,
        &[("resolution", "failed"), ("reason", "no charge")],
    );
    assert_eq!(
        ada.post("/key/resolve", &pairs(&earlier)).await.status(),
        StatusCode::CONFLICT
    );
    assert_eq!(consoles.find(&second).await.state, KeyState::NeedsReview);
}

/// The text of the first history entry of `kind` on a key's page.
fn event(html: &str, kind: &str) -> String {
    let needle = format!(r#"<li class="event" data-kind="{kind}">"#);
    let at = html
        .find(&needle)
        .unwrap_or_else(|| panic!("no {kind} event in {html}"));
    let rest = &html[at..];
    unescape(&rest[..rest.find("</li>").unwrap()])
}

/// A parked key handed back goes to pending for the resumer, with a `handed_back` event by the
/// operator; the action forms are gone, and a second hand-back from the same page is 409.
async fn hand_back_returns_the_key_to_the_resumer(consoles: Consoles) {
    let parked = key("mail", "k-back");
    consoles.park(&parked).await;
    let browser = consoles.sign_in(&consoles.actions).await;
    let page = browser.key_page(&parked).await;
    assert!(page.contains(r#"<form id="hand-back" method="post" action="/key/hand-back""#));
    let form = with(
        &action_form(&page, &parked),
        &[("reason", "the provider answers again")],
    );
    let answer = browser.post("/key/hand-back", &pairs(&form)).await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let location = answer.headers()[header::LOCATION]
        .to_str()
        .unwrap()
        .to_owned();
    let (_, after) = browser.get(&location).await;
    assert_eq!(text_of(&after, "key-state"), "pending");
    assert!(after.contains(r#"id="flash""#) && !after.contains(r#"id="hand-back""#));
    let handed = event(&after, "handed_back");
    assert!(
        handed.contains("ada") && handed.contains("the provider answers again"),
        "{handed}"
    );
    let row = consoles.find(&parked).await;
    assert_eq!(row.state, KeyState::Pending);
    assert_eq!(
        browser.post("/key/hand-back", &pairs(&form)).await.status(),
        StatusCode::CONFLICT
    );
    assert_eq!(consoles.find(&parked).await.updated_at, row.updated_at);
}

/// The list pages with a keyset cursor: every parked key once over the pages.
async fn the_list_pages_on_a_cursor(consoles: Consoles) {
    let total = 57;
    for i in 0..total {
        consoles.park(&key("bulk-mail", &format!("k-{i:03}"))).await;
    }
    let browser = consoles.sign_in(&consoles.read_only).await;
    let mut seen = std::collections::BTreeSet::new();
    let mut path = "/keys?state=needs_review&operation=bulk-mail".to_owned();
    let mut pages = 0;
    loop {
        let (status, html) = browser.get(&path).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        pages += 1;
        for (at, _) in html.match_indices(r#"class="key-link" href=""#) {
            let rest = &html[at..];
            let name = &rest[rest.find('>').unwrap() + 1..rest.find("</a>").unwrap()];
            assert!(seen.insert(name.to_owned()), "{name} shown twice");
        }
        let needle = r#"<a id="next-page" href=""#;
        match html.find(needle) {
            Some(at) => {
                let rest = &html[at + needle.len()..];
                path = unescape(&rest[..rest.find('"').unwrap()]);
            }
            None => break,
        }
    }
    assert_eq!(pages, 2);
    assert_eq!(seen.len(), total);
}

/// The bulk preview counts the parked keys of the filter; the confirmation acts on exactly
/// those, each fenced: a key changed meanwhile is left as it is, and one parked after the
/// preview is not touched.
async fn bulk_acts_on_the_previewed_keys(consoles: Consoles) {
    let keys: Vec<_> = (0..4).map(|i| key("mail", &format!("b-{i}"))).collect();
    for key in &keys {
        consoles.park(key).await;
    }
    consoles.park(&key("other", "b-x")).await;
    let browser = consoles.sign_in(&consoles.actions).await;
    let (_, list) = browser.get("/keys?state=needs_review&operation=mail").await;
    let csrf = value(&list, "csrf");
    let answer = browser
        .post(
            "/keys/bulk",
            &[
                ("csrf", &csrf),
                ("operation", "mail"),
                ("scope", ""),
                ("older_than", ""),
                ("action", "failed"),
            ],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::OK);
    let preview = answer.text().await.unwrap();
    assert_eq!(text_of(&preview, "bulk-count"), "4 keys");
    let previewed = values(&preview, "k");
    assert_eq!(previewed.len(), 4);

    // Meanwhile: one previewed key is resolved elsewhere, and a new one is parked.
    let elsewhere = consoles.sign_in(&consoles.actions).await;
    let page = elsewhere.key_page(&keys[0]).await;
    let form = with(
        &action_form(&page, &keys[0]),
        &[
            ("resolution", "completed"),
            ("result", "{}"),
            ("reason", "sent"),
        ],
    );
    assert_eq!(
        elsewhere.post("/key/resolve", &pairs(&form)).await.status(),
        StatusCode::SEE_OTHER
    );
    let late = key("mail", "b-late");
    consoles.park(&late).await;

    let mut confirm: Vec<(&str, &str)> =
        vec![("csrf", &csrf), ("action", "failed"), ("operator", "ada")];
    confirm.extend(previewed.iter().map(|k| ("k", k.as_str())));
    assert_eq!(
        browser.post("/keys/bulk/confirm", &confirm).await.status(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "no reason"
    );
    confirm.push(("reason", "the mailer shows none of these sent"));
    let answer = browser.post("/keys/bulk/confirm", &confirm).await;
    assert_eq!(answer.status(), StatusCode::OK);
    let report = answer.text().await.unwrap();
    assert_eq!(text_of(&report, "bulk-acted"), "3");
    assert_eq!(consoles.find(&keys[0]).await.state, KeyState::Completed);
    for key in &keys[1..] {
        assert_eq!(consoles.find(key).await.state, KeyState::Failed);
    }
    assert_eq!(consoles.find(&late).await.state, KeyState::NeedsReview);
    assert_eq!(
        consoles.find(&key("other", "b-x")).await.state,
        KeyState::NeedsReview
    );
}

test_support::backend_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    every_page_needs_a_credential,
    posts_without_the_csrf_token_are_refused,
    read_only_refuses_actions,
    resolve_with_a_reason_and_refuse_stale_pages,
    hand_back_returns_the_key_to_the_resumer,
    the_list_pages_on_a_cursor,
    bulk_acts_on_the_previewed_keys,
}

/// The console refuses to start without a password (exit 2, before connecting); the password
/// may come from a file, whose first line it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_comes_from_the_environment_or_a_file() {
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .env_remove("IDEM_CONSOLE_PASSWORD")
        .args([
            "--database-url",
            "sqlite:///nonexistent/never-opened.db",
            "console",
        ])
        .output()
        .expect("run idem");
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("IDEM_CONSOLE_PASSWORD"));

    let database = TestDatabase::Sqlite.fresh_database().await.unwrap();
    SqliteStore::connect(&database.url)
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("password");
    std::fs::write(&file, "from-a-file\nignored second line\n").unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    command
        .env_remove("IDEM_CONSOLE_PASSWORD")
        .args([
            "--database-url",
            &database.url,
            "console",
            "--listen",
            "127.0.0.1:0",
            "--password-file",
        ])
        .arg(&file)
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let base = line.strip_prefix("idem console: listening on ").unwrap();
    let http = Client::builder()
        .redirect(redirect::Policy::none())
        .build()
        .unwrap();
    let sign_in = |password: &'static str| {
        http.post(format!("{base}/sign-in"))
            .form(&[("password", password)])
            .send()
    };
    assert_eq!(
        sign_in("from-a-file").await.unwrap().status(),
        StatusCode::SEE_OTHER
    );
    assert_eq!(
        sign_in("from-a-file\nignored second line")
            .await
            .unwrap()
            .status(),
        StatusCode::UNAUTHORIZED
    );
    drop(child);
}
