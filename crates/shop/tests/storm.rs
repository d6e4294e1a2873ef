//! The retry storm, bounded, through the real binary: on SQLite in one process, and on
//! PostgreSQL with two `shop` processes sharing the database.

mod common;

use std::process::Command;

fn storm(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_shop"))
        .arg("storm")
        .args([
            "--users",
            "6",
            "--operations",
            "12",
            "--duplicates",
            "3",
            "--quiet",
        ])
        .args(args)
        .output()
        .expect("run the storm");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "storm failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("invariants: OK"), "{stdout}");
    assert!(stdout.contains("checked 6 ledgers"), "{stdout}");
    // The storm knows the database: it waited for the worker and audited every charge.
    assert!(stdout.contains("no key left pending"), "{stdout}");
    assert!(stdout.contains("given up: "), "{stdout}");
    stdout
}

#[test]
fn storm_on_sqlite() {
    let file = test_support::fresh_sqlite();
    storm(&["--database-url", &file.url]);
}

/// Every purchase's client gives up after one try: the keys still end settled, and every charge
/// belongs to a paid order.
#[test]
fn storm_where_every_purchase_client_gives_up() {
    let file = test_support::fresh_sqlite();
    let out = storm(&[
        "--database-url",
        &file.url,
        "--give-up-share",
        "1",
        "--payment-fail-rate",
        "0.5",
    ]);
    assert!(out.contains("settled: "), "{out}");
}

#[tokio::test]
async fn storm_on_postgres_with_two_processes() {
    let Some(url) = test_support::fresh_postgres_url().await else {
        return;
    };
    let out =
        tokio::task::spawn_blocking(move || storm(&["--database-url", &url, "--processes", "2"]))
            .await
            .unwrap();
    assert!(out.contains("(2 processes"), "{out}");
}

/// The storm is not vacuous: against a shop whose purchases bypass the middleware it must report
/// violations (double charges) and fail.
#[test]
fn storm_catches_an_unguarded_shop() {
    let file = test_support::fresh_sqlite();
    let url = file.url.clone();
    let shop = common::start(
        &url,
        Some(file),
        &["--unguarded-purchases", "--payment-latency-ms", "5"],
    );
    let output = Command::new(env!("CARGO_BIN_EXE_shop"))
        .args([
            "storm",
            "--users",
            "3",
            "--operations",
            "6",
            "--duplicates",
            "3",
            "--quiet",
        ])
        .args(["--url", &shop.url])
        .output()
        .expect("run the storm");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        !output.status.success(),
        "the storm passed a broken shop:\n{stdout}"
    );
    assert!(stdout.contains("VIOLATION"), "{stdout}");
    assert!(
        stdout.contains("charges"),
        "double charges reported: {stdout}"
    );
}
