//! "Not now" is recognised from the errors real servers send during a failover, a shutdown, a
//! pooler's or an administrator's disconnect, a write on a standby, or a lock wait: each is
//! `is_unavailable_error` (the HTTP layer answers 503 with `Retry-After`), made here on real
//! PostgreSQL and MariaDB servers.

use idempotency::store::is_unavailable_error;
use sqlx::{Connection, Executor, MySqlConnection, PgConnection};

fn code(error: &sqlx::Error) -> Option<String> {
    error
        .as_database_error()
        .and_then(|db| db.code().map(|c| c.into_owned()))
}

#[tokio::test]
async fn postgres_terminated_backend_and_read_only_transaction_are_not_now() {
    let Some(url) = test_support::fresh_postgres_url().await else {
        return;
    };
    // 57P01: the backend is terminated by an administrator (as on a fast shutdown or failover).
    let mut victim = PgConnection::connect(&url).await.expect("connect");
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut victim)
        .await
        .expect("pid");
    let mut admin = PgConnection::connect(&url).await.expect("connect");
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(&mut admin)
        .await
        .expect("terminate");
    let error = sqlx::query("SELECT 1")
        .execute(&mut victim)
        .await
        .expect_err("the terminated connection fails");
    assert!(is_unavailable_error(&error), "{error:?}");

    // 25006: a write in a read-only transaction, as on a standby not yet promoted.
    let mut tx = admin.begin().await.expect("begin");
    tx.execute("SET TRANSACTION READ ONLY")
        .await
        .expect("read only");
    let error = tx
        .execute("CREATE TABLE written_on_a_standby (id int)")
        .await
        .expect_err("a read-only transaction refuses a write");
    assert_eq!(code(&error).as_deref(), Some("25006"), "{error:?}");
    assert!(is_unavailable_error(&error), "{error:?}");
}

#[tokio::test]
async fn mariadb_lock_wait_timeout_and_killed_connection_are_not_now() {
    let Some(url) = test_support::fresh_mysql_url().await else {
        return;
    };
    let mut holder = MySqlConnection::connect(&url).await.expect("connect");
    holder
        .execute("CREATE TABLE account (id INT PRIMARY KEY, balance INT) ENGINE=InnoDB")
        .await
        .expect("table");
    holder
        .execute("INSERT INTO account VALUES (1, 0)")
        .await
        .expect("row");
    let mut tx = holder.begin().await.expect("begin");
    tx.execute("UPDATE account SET balance = 1 WHERE id = 1")
        .await
        .expect("lock the row");

    // 1205 (SQLSTATE HY000): a lock wait timeout.
    let mut waiter = MySqlConnection::connect(&url).await.expect("connect");
    waiter
        .execute("SET SESSION innodb_lock_wait_timeout = 1")
        .await
        .expect("short wait");
    let waiter_id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut waiter)
        .await
        .expect("id");
    let error = waiter
        .execute("UPDATE account SET balance = 2 WHERE id = 1")
        .await
        .expect_err("the row is locked");
    assert!(is_unavailable_error(&error), "{error:?}");
    tx.rollback().await.expect("rollback");

    // An administrator's KILL CONNECTION (1927 or a lost connection, as a failover does).
    sqlx::query(&format!("KILL CONNECTION {waiter_id}"))
        .execute(&mut holder)
        .await
        .expect("kill");
    let error = waiter
        .execute("SELECT 1")
        .await
        .expect_err("the killed connection fails");
    assert!(is_unavailable_error(&error), "{error:?}");

    // Not every error is "not now": a duplicate key is for good.
    let error = holder
        .execute("INSERT INTO account VALUES (1, 0)")
        .await
        .expect_err("duplicate");
    assert!(!is_unavailable_error(&error), "{error:?}");
}
