//! The review console in a real browser: Debian's chromium, driven through chromedriver, against
//! `idem console` over a SQLite database seeded by the shop's storm with parked e-mails.
//!
//! Without credentials every page answers 401 and a post without the CSRF token 403 (checked with
//! plain HTTP, since WebDriver does not expose status codes). In the browser: sign in, filter to
//! needs-review, open a key and see its history, resolve it with a reason, see the new history
//! entry and the key's new state; a second browser session that loaded the same key's page before
//! the resolve is refused (409) and the key stays as the first session left it.
//!
//! Screenshots of the overview and of a key's page go to the folder named by `CONSOLE_SCREENSHOTS`
//! (relative to the workspace root; `CONSOLE_SCREENSHOTS=docs` refreshes the README's pictures),
//! else to a temporary folder. Outside CI the test skips when chromium or chromedriver is missing;
//! in CI (`CI` set) it fails instead.

use clap::Parser;
use fantoccini::{error::CmdError, Client, ClientBuilder, Locator};
use futures_util::FutureExt;
use serde_json::{json, Value};
use sqlx::{Connection, SqliteConnection};
use std::{
    future::Future,
    panic::AssertUnwindSafe,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};
use tokio::io::{AsyncBufReadExt, BufReader};

const CHROMIUM: &str = "/usr/bin/chromium";
const PASSWORD: &str = "a console password for the browser test";
/// How long any one thing may take to appear (a loaded 2-core machine runs chromium slowly).
const WAIT: Duration = Duration::from_secs(30);
/// How long a process (chromedriver, the console) may take to start.
const START: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_a_real_browser() {
    let Some(chromedriver) = browser_tools() else {
        return;
    };
    let db = test_support::fresh_sqlite();
    seed(&db.url).await;
    let parked = keys_in_state(&db.url, "needs_review").await;
    assert!(
        !parked.is_empty(),
        "the storm parked no e-mail for review: nothing to resolve"
    );

    let console = Console::start(&db.url).await;
    without_credentials(&console.base, &db.url, &parked[0]).await;

    let driver = ChromeDriver::start(&chromedriver).await;
    let first = driver.session().await;
    let second = driver.session().await;
    let outcome = AssertUnwindSafe(in_the_browser(
        &first.client,
        &second.client,
        &console.base,
        &db.url,
        parked.len(),
    ))
    .catch_unwind()
    .await;
    // Close the browsers even when a step failed: chromedriver's end does not end them.
    for session in [first, second] {
        let _ = session.client.close().await;
    }
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// The browser steps: sign in, filter, open, screenshot, resolve, and the stale second session.
async fn in_the_browser(first: &Client, second: &Client, base: &str, db_url: &str, parked: usize) {
    sign_in(first, base).await;
    first
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Id("counts"))
        .await
        .expect("the overview's counts after signing in");
    first
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Id("oldest"))
        .await
        .expect("the overview's oldest keys");
    screenshot(first, "console-overview.png").await;

    let key_page = filter_to_needs_review(first, base, parked).await;
    open_key(first, &key_page).await;
    screenshot(first, "console-key.png").await;

    // The second operator opens the same key before the first one resolves it.
    sign_in(second, base).await;
    second
        .goto(&key_page)
        .await
        .expect("second session: key page");
    wait_text(second, "key-state", "needs_review").await;
    wait_css(second, "#resolve").await;

    resolve(first, "failed", "mail provider confirmed nothing was sent").await;
    wait_css(first, "#flash").await;
    wait_text(first, "key-state", "failed").await;
    let resolved = wait_css(first, "#history li.event[data-kind=\"resolved\"]").await;
    let text = resolved.text().await.expect("the resolved entry's text");
    assert!(text.contains("first-operator"), "who resolved: {text}");
    assert!(
        text.contains("mail provider confirmed nothing was sent"),
        "why: {text}"
    );

    stale_resolve_is_refused(second, &key_page).await;
    let (scope, operation, key) = key_of(&key_page);
    let state = key_state(db_url, &scope, &operation, &key).await;
    assert_eq!(state, "failed", "the stale resolve changed the key");
}

/// The second session submits its resolve from the page it loaded before the first resolve: 409,
/// `#problem` shown, and the key's page still shows the first resolve only.
async fn stale_resolve_is_refused(second: &Client, key_page: &str) {
    second
        .find(Locator::Id("result"))
        .await
        .expect("result field")
        .send_keys(r#"{"message_id":"stale"}"#)
        .await
        .expect("type the result");
    resolve(
        second,
        "completed",
        "the second tab had not seen the change",
    )
    .await;
    let problem = wait_css(second, "#problem").await;
    assert!(
        problem.is_displayed().await.expect("problem visibility"),
        "the refusal is shown"
    );
    let status = second
        .execute(
            "return performance.getEntriesByType('navigation')[0].responseStatus;",
            vec![],
        )
        .await
        .expect("the navigation's status");
    assert_eq!(status, json!(409), "a stale resolve answers 409");

    second.goto(key_page).await.expect("reload the key page");
    wait_text(second, "key-state", "failed").await;
    let resolved = second
        .find_all(Locator::Css("#history li.event[data-kind=\"resolved\"]"))
        .await
        .expect("resolved entries");
    assert_eq!(resolved.len(), 1, "one resolve recorded, the stale one not");
    let text = resolved[0].text().await.expect("resolved entry text");
    assert!(!text.contains("second-operator"), "{text}");
}

/// The filter form narrows the list to needs-review keys; returns the first key's page URL.
async fn filter_to_needs_review(client: &Client, base: &str, parked: usize) -> String {
    client
        .goto(&format!("{base}/keys"))
        .await
        .expect("keys list");
    let state = wait_css(client, "#filters #filter-state").await;
    state
        .select_by_value("needs_review")
        .await
        .expect("choose needs_review");
    client
        .find(Locator::Id("filter-submit"))
        .await
        .expect("filter button")
        .click()
        .await
        .expect("submit the filters");
    until("the list filtered to needs_review", || async {
        let url = client.current_url().await?;
        let filtered = url.path() == "/keys"
            && url
                .query_pairs()
                .any(|(k, v)| k == "state" && v == "needs_review");
        Ok(filtered.then_some(()))
    })
    .await;
    wait_css(client, "#keys").await;
    let rows = client
        .find_all(Locator::Css("#keys tr.key-row"))
        .await
        .expect("key rows");
    assert_eq!(rows.len(), parked, "one row per needs-review key");
    let link = client
        .find(Locator::Css("#keys tr.key-row a.key-link"))
        .await
        .expect("a key link");
    let href = link.prop("href").await.expect("href").expect("a link");
    assert!(href.contains("/key?"), "{href}");
    href
}

/// Opens a key from the list and checks its state and history.
async fn open_key(client: &Client, key_page: &str) {
    client
        .find(Locator::Css("#keys tr.key-row a.key-link"))
        .await
        .expect("the key link")
        .click()
        .await
        .expect("open the key");
    until("the key's page", || async {
        Ok((client.current_url().await?.as_str() == key_page).then_some(()))
    })
    .await;
    wait_text(client, "key-state", "needs_review").await;
    wait_css(client, "#history li.event[data-kind=\"parked\"]").await;
    let mut kinds = Vec::new();
    for event in client
        .find_all(Locator::Css("#history li.event"))
        .await
        .expect("history entries")
    {
        kinds.push(event.attr("data-kind").await.expect("data-kind"));
    }
    let kinds: Vec<String> = kinds.into_iter().flatten().collect();
    for kind in ["reserved", "parked"] {
        assert!(kinds.iter().any(|k| k == kind), "{kind} in {kinds:?}");
    }
    wait_css(client, "#resolve").await;
}

/// Fills and submits the resolve form on the current key page.
async fn resolve(client: &Client, resolution: &str, reason: &str) {
    let operator = if resolution == "failed" {
        "first-operator"
    } else {
        "second-operator"
    };
    client
        .find(Locator::Id("resolution"))
        .await
        .expect("resolution choice")
        .select_by_value(resolution)
        .await
        .expect("choose the resolution");
    for (field, value) in [
        ("operator", operator),
        ("reason", reason),
        ("evidence", "mail provider log, 09:14"),
    ] {
        client
            .find(Locator::Id(field))
            .await
            .unwrap_or_else(|e| panic!("field {field}: {e}"))
            .send_keys(value)
            .await
            .unwrap_or_else(|e| panic!("type into {field}: {e}"));
    }
    client
        .find(Locator::Id("resolve-submit"))
        .await
        .expect("resolve button")
        .click()
        .await
        .expect("submit the resolve");
}

async fn sign_in(client: &Client, base: &str) {
    client
        .goto(&format!("{base}/"))
        .await
        .expect("open the console");
    let password = wait_css(client, "#sign-in #password").await;
    password
        .send_keys(PASSWORD)
        .await
        .expect("type the password");
    client
        .find(Locator::Id("sign-in-submit"))
        .await
        .expect("sign-in button")
        .click()
        .await
        .expect("sign in");
    until("the signed-in overview", || async {
        Ok((client.current_url().await?.path() == "/"
            && client.find(Locator::Id("sign-in")).await.is_err())
        .then_some(()))
    })
    .await;
}

/// Step 1, over plain HTTP: 401 without credentials, 403 for a post without its CSRF token.
async fn without_credentials(base: &str, db_url: &str, key: &(String, String, String)) {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("HTTP client");
    let (scope, operation, idem_key) = key;
    let key_query = form(&[
        ("scope", scope),
        ("operation", operation),
        ("key", idem_key),
    ]);
    for path in ["/", "/keys", "/keys?state=needs_review"] {
        let answer = http.get(format!("{base}{path}")).send().await.expect("GET");
        assert_eq!(answer.status(), 401, "GET {path} without credentials");
    }
    let answer = http
        .get(format!("{base}/key?{key_query}"))
        .send()
        .await
        .expect("GET key");
    assert_eq!(answer.status(), 401, "a key's page without credentials");
    let page = answer.text().await.expect("401 body");
    assert!(
        page.contains("id=\"sign-in\""),
        "the 401 page signs in: {page}"
    );

    let wrong = http
        .post(format!("{base}/sign-in"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("password", "not the password")]))
        .send()
        .await
        .expect("sign in wrongly");
    assert_eq!(wrong.status(), 401, "a wrong password");
    assert!(wrong.headers().get("set-cookie").is_none(), "no session");

    let cookie = sign_in_over_http(&http, base).await;
    let overview = http
        .get(format!("{base}/"))
        .header("cookie", &cookie)
        .send()
        .await
        .expect("GET / signed in");
    assert_eq!(overview.status(), 200, "the session cookie signs in");
    let csp = overview
        .headers()
        .get("content-security-policy")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(csp.contains("default-src 'none'"), "CSP: {csp:?}");

    let resolve = form(&[
        ("scope", scope),
        ("operation", operation),
        ("key", idem_key),
        ("resolution", "failed"),
        ("operator", "forger"),
        ("reason", "no CSRF token"),
    ]);
    let post = |body: String, cookie: Option<&str>| {
        let mut request = http
            .post(format!("{base}/key/resolve"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body);
        if let Some(cookie) = cookie {
            request = request.header("cookie", cookie);
        }
        request.send()
    };
    let answer = post(resolve.clone(), None).await.expect("POST");
    assert_eq!(answer.status(), 401, "a post without credentials");
    let answer = post(resolve.clone(), Some(&cookie)).await.expect("POST");
    assert_eq!(answer.status(), 403, "a post without its CSRF token");
    let forged = format!("{resolve}&csrf=forged-token");
    let answer = post(forged, Some(&cookie)).await.expect("POST");
    assert_eq!(answer.status(), 403, "a post with a forged CSRF token");
    let state = key_state(db_url, scope, operation, idem_key).await;
    assert_eq!(state, "needs_review", "a refused post changed the key");
}

/// Signs in with the password over HTTP; returns the session cookie (`name=value`).
async fn sign_in_over_http(http: &reqwest::Client, base: &str) -> String {
    let answer = http
        .post(format!("{base}/sign-in"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[("password", PASSWORD)]))
        .send()
        .await
        .expect("sign in");
    assert_eq!(answer.status(), 303, "a right password redirects");
    assert_eq!(
        answer
            .headers()
            .get("location")
            .and_then(|v| v.to_str().ok()),
        Some("/"),
        "to the overview"
    );
    let set_cookie = answer
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .expect("a session cookie")
        .to_owned();
    let lower = set_cookie.to_ascii_lowercase();
    assert!(lower.contains("httponly"), "{set_cookie}");
    assert!(lower.contains("samesite=strict"), "{set_cookie}");
    set_cookie
        .split(';')
        .next()
        .expect("name=value")
        .trim()
        .to_owned()
}

fn form(fields: &[(&str, &str)]) -> String {
    let mut url = url_for_encoding();
    url.query_pairs_mut().extend_pairs(fields);
    url.query().unwrap_or_default().to_owned()
}

fn url_for_encoding() -> reqwest::Url {
    "http://encoding.invalid/".parse().expect("a URL")
}

/// The (scope, operation, key) of a key page's URL.
fn key_of(key_page: &str) -> (String, String, String) {
    let url: reqwest::Url = key_page.parse().expect("key page URL");
    let get = |name: &str| {
        url.query_pairs()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
            .unwrap_or_else(|| panic!("{name} in {key_page}"))
    };
    (get("scope"), get("operation"), get("key"))
}

// --- waiting ------------------------------------------------------------------------------------

/// Polls `check` until it gives a value; fails the test after [`WAIT`].
async fn until<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, CmdError>>,
{
    let started = Instant::now();
    loop {
        match check().await {
            Ok(Some(value)) => return value,
            Ok(None) => {}
            Err(e) => panic!("waiting for {what}: {e}"),
        }
        assert!(
            started.elapsed() < WAIT,
            "{what} did not come within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn wait_css(client: &Client, css: &str) -> fantoccini::elements::Element {
    client
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("{css} did not appear: {e}"))
}

/// Waits until the element `id` shows `text` (trimmed).
async fn wait_text(client: &Client, id: &str, text: &str) {
    until(&format!("#{id} to read {text:?}"), || async {
        match client.find(Locator::Id(id)).await {
            Ok(element) => Ok((element.text().await?.trim() == text).then_some(())),
            Err(CmdError::Standard(e))
                if e.error == fantoccini::error::ErrorStatus::NoSuchElement =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    })
    .await;
}

/// Saves a PNG of the whole page (up to 2400 pixels high): the window grows to the page's height
/// for the picture, then goes back to 1280x900.
async fn screenshot(client: &Client, name: &str) {
    let sizes = client
        .execute(
            "return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight];",
            vec![],
        )
        .await
        .expect("the page's height");
    let px = |i: usize| sizes[i].as_u64().unwrap_or(0) as u32;
    let height = (px(0) + px(1)).clamp(900, 2400);
    client
        .set_window_size(1280, height)
        .await
        .expect("grow the window");
    let png = client.screenshot().await.expect("screenshot");
    client
        .set_window_size(1280, 900)
        .await
        .expect("window back to 1280x900");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    let dir = screenshot_dir();
    std::fs::create_dir_all(&dir).expect("screenshot folder");
    let path = dir.join(name);
    std::fs::write(&path, png).expect("write the screenshot");
    println!("screenshot: {}", path.display());
}

/// `CONSOLE_SCREENSHOTS` (relative to the workspace root), else a temporary folder kept for the
/// test's run.
fn screenshot_dir() -> PathBuf {
    match std::env::var_os("CONSOLE_SCREENSHOTS") {
        Some(dir) if !dir.is_empty() => {
            let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
            let root = crate_dir.ancestors().nth(2).expect("the workspace root");
            root.join(dir)
        }
        _ => std::env::temp_dir().join(format!("console-screenshots-{}", std::process::id())),
    }
}

// --- the seeded database ------------------------------------------------------------------------

/// The shop's storm, in this process, on `url`: every e-mail's outcome is unknown, so each is
/// parked for review.
async fn seed(url: &str) {
    #[derive(Parser)]
    struct Storm {
        #[command(flatten)]
        args: shop::storm::StormArgs,
    }
    let storm = Storm::parse_from([
        "storm",
        "--database-url",
        url,
        "--users",
        "3",
        "--operations",
        "6",
        "--duplicates",
        "2",
        "--mail-fail-rate",
        "1",
        "--settle-timeout-secs",
        "120",
        "--quiet",
    ]);
    shop::storm::run(storm.args).await.expect("the storm");
}

async fn connect(url: &str) -> SqliteConnection {
    SqliteConnection::connect(url)
        .await
        .expect("open the seeded database")
}

async fn keys_in_state(url: &str, state: &str) -> Vec<(String, String, String)> {
    let mut conn = connect(url).await;
    sqlx::query_as(
        "SELECT scope, operation, idem_key FROM idempotency_keys WHERE state = ?
         ORDER BY scope, operation, idem_key",
    )
    .bind(state)
    .fetch_all(&mut conn)
    .await
    .expect("read the keys")
}

async fn key_state(url: &str, scope: &str, operation: &str, key: &str) -> String {
    let mut conn = connect(url).await;
    sqlx::query_scalar(
        "SELECT state FROM idempotency_keys WHERE scope = ? AND operation = ? AND idem_key = ?",
    )
    .bind(scope)
    .bind(operation)
    .bind(key)
    .fetch_one(&mut conn)
    .await
    .expect("read the key's state")
}

// --- the processes ------------------------------------------------------------------------------

/// `idem console` on a free port, killed on drop.
struct Console {
    _child: tokio::process::Child,
    base: String,
}

impl Console {
    async fn start(db_url: &str) -> Self {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["console", "--database-url", db_url])
            .args(["--listen", "127.0.0.1:0", "--allow-actions"])
            .env("IDEM_CONSOLE_PASSWORD", PASSWORD)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start idem console");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let base = tokio::time::timeout(START, async {
            while let Some(line) = lines.next_line().await.expect("console output") {
                if let Some(url) = line.strip_prefix("idem console: listening on ") {
                    return url.trim().trim_end_matches('/').to_owned();
                }
            }
            panic!("idem console exited before listening");
        })
        .await
        .expect("idem console did not start in time");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Console {
            _child: child,
            base,
        }
    }
}

/// The path of chromedriver when chromium and chromedriver are installed. Outside CI a missing
/// one skips the test (None); in CI it fails it.
fn browser_tools() -> Option<PathBuf> {
    let chromedriver = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists());
    let in_ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    match chromedriver {
        Some(driver) if Path::new(CHROMIUM).exists() => Some(driver),
        _ if in_ci => panic!(
            "CI needs {CHROMIUM} and chromedriver (apt-get install chromium chromium-driver)"
        ),
        _ => {
            println!(
                "skipped: the console's browser test needs {CHROMIUM} and chromedriver \
                 (apt-get install chromium chromium-driver)"
            );
            None
        }
    }
}

/// chromedriver on a free port, killed on drop.
struct ChromeDriver {
    _child: tokio::process::Child,
    url: String,
}

/// One browser: a WebDriver session with its own profile folder.
struct Session {
    client: Client,
    _profile: tempfile::TempDir,
}

impl ChromeDriver {
    async fn start(path: &Path) -> Self {
        // A port found free may be taken before chromedriver binds it: try a few.
        for _ in 0..3 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let mut child = tokio::process::Command::new(path)
                .arg(format!("--port={port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .expect("start chromedriver");
            let url = format!("http://127.0.0.1:{port}");
            if ready(&url, &mut child).await {
                return ChromeDriver { _child: child, url };
            }
        }
        panic!("chromedriver did not start");
    }

    async fn session(&self) -> Session {
        let profile = tempfile::tempdir().expect("profile folder");
        let args = [
            "--headless".to_owned(),
            "--no-sandbox".to_owned(),
            "--disable-gpu".to_owned(),
            "--disable-dev-shm-usage".to_owned(),
            "--disable-quic".to_owned(),
            "--no-first-run".to_owned(),
            "--disable-background-networking".to_owned(),
            "--disable-component-update".to_owned(),
            "--disable-sync".to_owned(),
            "--window-size=1280,900".to_owned(),
            format!("--user-data-dir={}", profile.path().display()),
        ];
        let capabilities = json!({
            "browserName": "chrome",
            "goog:chromeOptions": { "binary": CHROMIUM, "args": args },
        });
        let Value::Object(capabilities) = capabilities else {
            unreachable!("an object")
        };
        let client = tokio::time::timeout(
            START,
            ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                .capabilities(capabilities)
                .connect(&self.url),
        )
        .await
        .expect("chromium did not start in time")
        .expect("a WebDriver session");
        Session {
            client,
            _profile: profile,
        }
    }
}

/// Waits until chromedriver answers its status; false when it exited (its port was taken).
async fn ready(url: &str, child: &mut tokio::process::Child) -> bool {
    let http = reqwest::Client::new();
    let started = Instant::now();
    while started.elapsed() < START {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if let Ok(answer) = http.get(format!("{url}/status")).send().await {
            if answer.status().is_success() {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("chromedriver did not answer within {START:?}");
}
