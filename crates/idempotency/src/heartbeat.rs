//! [`Heartbeat`]: keeps a held lease from ending while its holder is alive.

use crate::{key::IdempotencyKey, store::LeaseToken, store::Store};
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};
use tokio::sync::watch;

/// A task that extends a held lease every third of its length, conditional on the lease token
/// and by the database's clock ([`Store::extend_lease`]). It stops when dropped (the lease was
/// finished, released, parked or left pending) and when it finds the token gone (the key was
/// taken over or settled): it then flags the lease as lost, and the holder's completion fails
/// with [`Error::LeaseLost`](crate::Error::LeaseLost). A holder that dies stops beating, so its
/// key can be taken over or recovered one lease after its last beat.
#[derive(Debug)]
pub(crate) struct Heartbeat {
    /// Dropped to stop the task.
    _stop: watch::Sender<()>,
    lost: Arc<AtomicBool>,
}

impl Heartbeat {
    /// Starts beating for `key`, held with `token` for `lease`. `None` outside a tokio runtime
    /// (nothing to run the task on) and for a lease too short to beat.
    pub(crate) fn start<S: Store>(
        store: &S,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Option<Self> {
        let every = lease / 3;
        if every < Duration::from_millis(1) {
            return None;
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let (stop, mut stopped) = watch::channel(());
        let lost = Arc::new(AtomicBool::new(false));
        let (store, key, flag) = (store.clone(), key.clone(), lost.clone());
        runtime.spawn(async move {
            loop {
                // `changed` answers (with an error) once the sender is dropped: stop.
                if tokio::time::timeout(every, stopped.changed()).await.is_ok() {
                    return;
                }
                let extended = store.extend_lease(&key, token, lease).await;
                if stopped.has_changed().is_err() {
                    // Stopped while the statement ran: the holder settled the key meanwhile.
                    return;
                }
                match extended {
                    Ok(true) => tracing::trace!(%key, "lease extended"),
                    Ok(false) => {
                        flag.store(true, Ordering::Release);
                        tracing::warn!(%key, "lease lost: the key was taken over or settled while its work ran; the work's completion will fail");
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(%error, %key, "could not extend the lease; trying again at the next beat")
                    }
                }
            }
        });
        Some(Self { _stop: stop, lost })
    }

    /// Whether a beat found the lease gone.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }
}
