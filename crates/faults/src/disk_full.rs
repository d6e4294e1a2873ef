//! The `disk-full` scenario (SQLite): the shop's files live on a small tmpfs, which a filler file
//! fills mid-storm. While the disk is full requests answer 503 problem JSON; once the filler is
//! deleted the same shop process goes on; nothing committed is lost or corrupted (`PRAGMA
//! integrity_check`), and every operation ends executed once or retryable.

use crate::{
    command::{self, words},
    scenarios::{as_strs, collect, print_verdict, purchase_workers, settle_and_check, Env, Outage},
    shop_process::ShopProcess,
};
use anyhow::{ensure, Context, Result};
use std::{
    io::Write,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

/// The size of the tmpfs the shop's files live on.
const DISK: &str = "24m";

/// Runs the scenario on a tmpfs mounted for it (needs root, like CI), and unmounts it after.
pub async fn disk_full(env: &Env) -> Result<()> {
    let mount = tempfile::tempdir()?;
    let path = mount.path().display().to_string();
    let size = format!("size={DISK}");
    command::run(&words("mount -t tmpfs -o"), &[&size, "tmpfs", &path])
        .await
        .context("mounting a tmpfs for the shop's files (the disk-full scenario needs root)")?;
    let outcome = on_small_disk(env, mount.path()).await;
    // Lazily: a shop killed on an early failure may still hold its files for a moment.
    command::run(&words("umount --lazy"), &[&path]).await?;
    outcome
}

async fn on_small_disk(env: &Env, disk: &Path) -> Result<()> {
    let db = format!("sqlite://{}", disk.join("shop.db").display());
    let mut shop = ShopProcess::start(&env.shop_bin, &db, &as_strs(&env.shop_args())).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let workers = purchase_workers(shop.url(), 6, stop.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let filled = Instant::now();
    let filler = disk.join("filler");
    let written = tokio::task::spawn_blocking({
        let filler = filler.clone();
        move || fill(&filler)
    })
    .await??;
    let health_while_full = reqwest::get(format!("{}/healthz", shop.url())).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    tokio::fs::remove_file(&filler).await?;
    let full_for = filled.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let ops = collect(workers).await?;
    ensure!(
        health_while_full.status().is_success(),
        "the shop was not healthy while the disk was full"
    );
    shop.wait_healthy(Duration::from_secs(10)).await?;
    ensure!(shop.starts == 1, "the shop had to be restarted");
    ensure!(
        !shop.panicked(),
        "the shop panicked; log {}",
        shop.log().display()
    );
    let verdict = settle_and_check(env, &db, &ops)
        .await
        .with_context(|| format!("shop log {}", shop.log().display()))?;
    shop.kill9().await?;
    let outage = Outage::of(&ops);
    println!(
        "faults: disk-full: a {DISK} tmpfs filled ({} MB of filler) for {:.1}s, then freed; {} operations, {outage}; no restart",
        written / (1024 * 1024),
        full_for.as_secs_f64(),
        ops.len()
    );
    print_verdict("disk-full", &verdict);
    outage.ensure_seen_and_explained("the full disk")?;
    ensure!(verdict.executed_once > 0, "nothing executed");
    Ok(())
}

/// Writes zeros to `path` until the disk is full; returns the bytes written.
fn fill(path: &PathBuf) -> Result<u64> {
    let mut file = std::fs::File::create(path)?;
    let chunk = vec![0u8; 64 * 1024];
    let mut written = 0u64;
    loop {
        match file.write(&chunk) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
            Err(e) => return Err(e.into()),
        }
    }
    // The last partial pages too, then make sure it is on the (memory) disk.
    let _ = file.sync_all();
    Ok(written)
}
