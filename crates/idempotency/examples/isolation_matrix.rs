//! Prints the isolation matrix: how check-then-insert, `SELECT … FOR UPDATE` and this crate's
//! reserve-first protocol behave when concurrent duplicates race one fresh key, on PostgreSQL
//! (READ COMMITTED, REPEATABLE READ, SERIALIZABLE), MariaDB/InnoDB (READ COMMITTED, REPEATABLE
//! READ) and SQLite. See `docs/isolation-matrix.md`.
//!
//! ```sh
//! export TEST_POSTGRES_URL=postgres://idem:idem@127.0.0.1:5432/idem
//! export TEST_MYSQL_URL=mysql://idem:idem@127.0.0.1:3306/idem
//! cargo run -p idempotency --all-features --example isolation_matrix
//! ```
//!
//! Each cell gets a fresh database on those servers. `ISOLATION_MATRIX_TRIALS` and
//! `ISOLATION_MATRIX_WORKERS` change the default 200 trials x 8 workers.

#[cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[path = "isolation_matrix/matrix.rs"]
mod matrix;

#[cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    let config = matrix::Config::from_env();
    let mut reports = Vec::new();
    for backend in matrix::Engine::ALL {
        eprintln!("racing {backend} ...");
        match matrix::run_backend(backend, config).await {
            Some(report) => reports.push(report),
            None => eprintln!("{backend}: skipped (server not configured)"),
        }
    }
    println!("{}", matrix::render(&config, &reports));
}

#[cfg(not(all(feature = "postgres", feature = "mysql", feature = "sqlite")))]
fn main() {
    eprintln!("the isolation matrix needs every backend: run it with --all-features");
    std::process::exit(2);
}
