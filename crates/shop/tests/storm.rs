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
    stdout
}

#[test]
fn storm_on_sqlite() {
    let file = test_support::fresh_sqlite();
    storm(&["--database-url", &file.url]);
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
