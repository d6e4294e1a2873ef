//! What every handler of the console shares: the store, the settings, the signed-in sessions.

use super::auth::Sessions;
use std::{sync::Arc, time::Duration};

/// The console's settings, fixed at start.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Whether action forms are shown and action posts accepted.
    pub allow_actions: bool,
    /// JSON field names masked (recursively) in the stored request and the journal.
    pub redact: Vec<String>,
    /// How long a resolved key is kept.
    pub retention: Duration,
}

/// The state of a running console (cheap to clone).
#[derive(Debug, Clone)]
pub struct App<S> {
    /// The key table.
    pub store: S,
    /// The settings.
    pub settings: Arc<Settings>,
    /// The password and the signed-in sessions.
    pub sessions: Arc<Sessions>,
}

impl<S> axum::extract::FromRef<App<S>> for Arc<Sessions> {
    fn from_ref(app: &App<S>) -> Self {
        Arc::clone(&app.sessions)
    }
}
