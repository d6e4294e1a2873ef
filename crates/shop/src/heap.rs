//! Handing the allocator's free pages back to the operating system, so the shop's resident memory
//! follows its live heap.
//!
//! glibc's `malloc` keeps freed chunks inside its per-thread arenas and returns only the top of
//! the main arena to the kernel. Under `bench/rss.sh` on SQLite, the shop's RSS grew about
//! 12 MB per 10 minutes while its live heap did not: `malloc_trim(0)` called from a debugger
//! dropped it from 39.0 to 29.7 MB. [`trim_periodically`] makes that call every few seconds on a
//! blocking thread (`shop --heap-trim-ms`, 2 s by default). On other allocators and platforms it
//! does nothing.

use std::time::Duration;

/// Spawns a task that returns the allocator's free pages to the kernel every `period`, for as
/// long as the runtime lives. A no-op task outside Linux with glibc.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let trimming = shop::heap::trim_periodically(std::time::Duration::from_secs(10));
/// trimming.abort();
/// # }
/// ```
pub fn trim_periodically(period: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if !TRIMS {
            return;
        }
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            if tokio::task::spawn_blocking(trim).await.is_err() {
                return;
            }
        }
    })
}

/// Whether [`trim`] does anything on this platform.
const TRIMS: bool = cfg!(all(target_os = "linux", target_env = "gnu"));

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() {
    // SAFETY: malloc_trim takes no pointers and only walks glibc's own arenas under their locks;
    // it is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}
