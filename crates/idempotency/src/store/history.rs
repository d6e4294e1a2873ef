//! The history of a key: an append-only list of what happened to it (reserved, steps committed,
//! outside calls, claims, parking, resolution …), each event written in the same transaction (or
//! the same statement) as the change it records, and the operator's note that every operator
//! action carries.

use crate::error::StoreError;
use chrono::{DateTime, Utc};
use std::{fmt, str::FromStr};

/// At most this many bytes of an event's `detail` are stored (cut on a character boundary).
pub(crate) const DETAIL_MAX_BYTES: usize = 2048;

/// At most this many bytes of an event's `actor` are stored (cut on a character boundary).
pub(crate) const ACTOR_MAX_BYTES: usize = 255;

/// What happened to a key, as stored in the `kind` column of `idempotency_key_events`.
///
/// ```
/// use idempotency::maintenance::EventKind;
/// assert_eq!(EventKind::HandedBack.as_str(), "handed_back");
/// assert_eq!("call_started".parse::<EventKind>().unwrap(), EventKind::CallStarted);
/// assert!("banana".parse::<EventKind>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventKind {
    /// The key was reserved (a new row, or a reservation that took an old row over).
    Reserved,
    /// A durable step committed (detail: the step's name).
    StepCommitted,
    /// An outside call was about to be made (detail: the provider key).
    CallStarted,
    /// An outside call answered (detail: the provider key and an excerpt of the answer).
    CallAnswered,
    /// An outside call's outcome is unknown (detail: the provider key and the error).
    CallUnknown,
    /// A holder found its lease taken by another holder (actor: the holder that lost it).
    LeaseLost,
    /// A recovery job or a new reservation claimed an abandoned key (actor: the new holder).
    Claimed,
    /// The key was released (its effect known not to have happened).
    Released,
    /// The key was parked as `needs_review` (detail: the reason).
    Parked,
    /// The key completed.
    Completed,
    /// The key failed (an operator's resolution as failed, or a definitive refusal).
    Failed,
    /// An operator resolved the parked key (actor: the operator; detail: resolution, reason,
    /// evidence).
    Resolved,
    /// An operator handed the parked key back to the resumer (actor: the operator; detail:
    /// reason, evidence).
    HandedBack,
}

impl EventKind {
    /// Every kind, in the order a key's life usually meets them.
    pub const ALL: [EventKind; 13] = [
        EventKind::Reserved,
        EventKind::StepCommitted,
        EventKind::CallStarted,
        EventKind::CallAnswered,
        EventKind::CallUnknown,
        EventKind::LeaseLost,
        EventKind::Claimed,
        EventKind::Released,
        EventKind::Parked,
        EventKind::Completed,
        EventKind::Failed,
        EventKind::Resolved,
        EventKind::HandedBack,
    ];

    /// The name stored in the `kind` column.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Reserved => "reserved",
            EventKind::StepCommitted => "step_committed",
            EventKind::CallStarted => "call_started",
            EventKind::CallAnswered => "call_answered",
            EventKind::CallUnknown => "call_unknown",
            EventKind::LeaseLost => "lease_lost",
            EventKind::Claimed => "claimed",
            EventKind::Released => "released",
            EventKind::Parked => "parked",
            EventKind::Completed => "completed",
            EventKind::Failed => "failed",
            EventKind::Resolved => "resolved",
            EventKind::HandedBack => "handed_back",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EventKind {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EventKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == s)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown event kind {s:?}")))
    }
}

/// One entry of a key's history ([`Maintenance::history`](crate::store::Maintenance::history)).
///
/// ```
/// use idempotency::maintenance::{EventKind, KeyEvent};
/// let event = KeyEvent::new(chrono::Utc::now(), EventKind::Parked)
///     .with_detail("no resolver")
///     .with_actor("worker-1");
/// assert_eq!(event.detail.as_deref(), Some("no resolver"));
/// assert_eq!(event.actor.as_deref(), Some("worker-1"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyEvent {
    /// When, by the database clock (millisecond precision).
    pub at: DateTime<Utc>,
    /// What happened.
    pub kind: EventKind,
    /// The particulars (a step's name, a provider key and answer, a reason), bounded in length.
    pub detail: Option<String>,
    /// Who did it: a worker's name (`host:pid` unless configured) or an operator's name.
    pub actor: Option<String>,
}

impl KeyEvent {
    /// An event of `kind` at `at`, without detail or actor.
    pub fn new(at: DateTime<Utc>, kind: EventKind) -> Self {
        Self {
            at,
            kind,
            detail: None,
            actor: None,
        }
    }

    /// With `detail`.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// With `actor`.
    pub fn with_actor(mut self, actor: impl Into<String>) -> Self {
        self.actor = Some(actor.into());
        self
    }
}

/// Who takes an operator action and why: required by
/// [`Maintenance::resolve`](crate::store::Maintenance::resolve) and
/// [`Maintenance::hand_back`](crate::store::Maintenance::hand_back), and recorded in the key's
/// history.
///
/// `seen` fences the action against stale pages: it is the `updated_at` of the row the operator
/// looked at, and an action with `seen` set acts only if the row's `updated_at` still equals it
/// (compared at millisecond precision on every backend).
///
/// ```
/// use idempotency::maintenance::OperatorNote;
/// let note = OperatorNote::new("alice", "provider dashboard shows ch_42")
///     .with_evidence("https://dashboard.example/ch_42");
/// assert_eq!(note.operator, "alice");
/// assert!(note.seen.is_none());
/// assert_eq!(
///     note.detail(),
///     "provider dashboard shows ch_42 (evidence: https://dashboard.example/ch_42)"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OperatorNote {
    /// The operator's name, recorded as the event's actor.
    pub operator: String,
    /// Why: kept on the row and in the history.
    pub reason: String,
    /// What the decision rests on (a provider's dashboard link, a ticket), if given.
    pub evidence: Option<String>,
    /// The `updated_at` of the row the operator looked at; the action is refused if the row
    /// changed since.
    pub seen: Option<DateTime<Utc>>,
}

impl OperatorNote {
    /// `operator` acts for `reason`, without evidence and unfenced.
    pub fn new(operator: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            operator: operator.into(),
            reason: reason.into(),
            evidence: None,
            seen: None,
        }
    }

    /// With `evidence`.
    pub fn with_evidence(mut self, evidence: impl Into<String>) -> Self {
        self.evidence = Some(evidence.into());
        self
    }

    /// Acts only if the row's `updated_at` is still `seen` (at millisecond precision).
    pub fn with_seen(mut self, seen: DateTime<Utc>) -> Self {
        self.seen = Some(seen);
        self
    }

    /// The reason, then the evidence in parentheses: the detail of the event the action writes.
    pub fn detail(&self) -> String {
        match &self.evidence {
            Some(evidence) => format!("{} (evidence: {evidence})", self.reason),
            None => self.reason.clone(),
        }
    }

    /// `seen` in milliseconds since the Unix epoch, the form every backend compares.
    pub(crate) fn seen_millis(&self) -> Option<i64> {
        self.seen.map(|seen| seen.timestamp_millis())
    }

    /// The operator's name, bounded for the `actor` column.
    pub(crate) fn actor(&self) -> &str {
        bounded(&self.operator, ACTOR_MAX_BYTES)
    }
}

/// An event to append to a key's history, in the transaction (or statement) of its change.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
#[derive(Debug, Clone)]
pub(crate) struct NewEvent<'a> {
    /// What happened.
    pub(crate) kind: EventKind,
    /// Its particulars, already bounded.
    pub(crate) detail: Option<String>,
    /// Who did it, already bounded.
    pub(crate) actor: Option<&'a str>,
}

/// How long the history of a key that has no row any more (a released key never reserved
/// again) is kept after its newest event: the purge deletes such orphaned events once their
/// key's newest event is older than this (7 days).
pub(crate) const ORPHAN_RETENTION: std::time::Duration = std::time::Duration::from_secs(7 * 86_400);

/// `SELECT id` of at most `$limit` orphaned events: no key row, and no event of the same key
/// newer than `$cutoff` (an SQL expression), for [`ORPHAN_RETENTION`].
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
macro_rules! orphaned_events {
    ($cutoff:expr, $limit:expr) => {
        concat!(
            "SELECT e.id FROM idempotency_key_events e
              WHERE e.at <= ",
            $cutoff,
            "
                AND NOT EXISTS (SELECT 1 FROM idempotency_keys k
                                 WHERE k.scope = e.scope AND k.operation = e.operation
                                   AND k.idem_key = e.idem_key)
                AND NOT EXISTS (SELECT 1 FROM idempotency_key_events n
                                 WHERE n.scope = e.scope AND n.operation = e.operation
                                   AND n.idem_key = e.idem_key AND n.at > ",
            $cutoff,
            ")
              LIMIT ",
            $limit
        )
    };
}
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(crate) use orphaned_events;

/// Who this process is in a key's history unless a store is given a worker name: `host:pid`,
/// the host's name read from `/proc/sys/kernel/hostname` or `$HOSTNAME` (computed once).
pub(crate) fn default_actor() -> std::sync::Arc<str> {
    static ACTOR: std::sync::OnceLock<std::sync::Arc<str>> = std::sync::OnceLock::new();
    ACTOR
        .get_or_init(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|name| name.trim().to_owned())
                .filter(|name| !name.is_empty())
                .or_else(|| std::env::var("HOSTNAME").ok())
                .unwrap_or_else(|| "localhost".to_owned());
            format!("{host}:{}", std::process::id()).into()
        })
        .clone()
}

/// A worker name bounded for the `actor` column.
pub(crate) fn worker_actor(name: &str) -> std::sync::Arc<str> {
    bounded(name.trim(), ACTOR_MAX_BYTES).into()
}

/// The detail of an outside call's event: the provider key, then a bounded excerpt of the answer
/// (at most [`EXCERPT_MAX_BYTES`], cut on a character boundary).
pub(crate) fn call_detail(provider_key: &str, answer: Option<&str>) -> String {
    match answer {
        Some(answer) => format!("{provider_key} {}", bounded(answer, EXCERPT_MAX_BYTES)),
        None => provider_key.to_owned(),
    }
}

/// At most this many bytes of an outside call's answer are kept in its event.
pub(crate) const EXCERPT_MAX_BYTES: usize = 512;

/// The detail of a `resolved` event: the resolution, then the note's reason and evidence.
pub(crate) fn resolved_detail(state: &str, note: &OperatorNote) -> String {
    let detail = format!("{state}: {}", note.detail());
    bounded(&detail, DETAIL_MAX_BYTES).to_owned()
}

/// The detail of a `handed_back` event.
pub(crate) fn handed_back_detail(note: &OperatorNote) -> String {
    bounded(&note.detail(), DETAIL_MAX_BYTES).to_owned()
}

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary.
pub(crate) fn bounded(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A history row read back: converts the stored kind and checks it.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(crate) fn event(
    at: DateTime<Utc>,
    kind: &str,
    detail: Option<String>,
    actor: Option<String>,
) -> Result<KeyEvent, StoreError> {
    Ok(KeyEvent {
        at,
        kind: kind.parse()?,
        detail,
        actor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_cuts_on_a_character_boundary() {
        assert_eq!(bounded("abc", 5), "abc");
        assert_eq!(bounded("abcdef", 3), "abc");
        // 'é' is two bytes: a cut in its middle moves back before it.
        assert_eq!(bounded("aé", 2), "a");
        assert_eq!(bounded("aé", 3), "aé");
    }

    #[test]
    fn every_kind_reads_back() {
        for kind in EventKind::ALL {
            assert_eq!(kind.as_str().parse::<EventKind>().unwrap(), kind);
        }
    }
}
