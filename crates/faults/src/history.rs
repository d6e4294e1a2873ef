//! The history of purchases finished by the resumer after a real SIGKILL, read with the real
//! `idem keys history --json`: a purchase whose shop process was killed while its charge was
//! under way, and that the restarted shop's worker claimed and completed, reads back as
//! reserved, its step committed, the call started, the claim by another process, the call
//! answered, and the completion last.

use crate::client::OpReport;
use anyhow::{ensure, Context, Result};
use serde_json::Value;
use std::path::Path;

/// The operation the shop protects its purchases under (`shop::purchase::PURCHASE`).
const PURCHASE: &str = "purchase";

/// At most this many keys are read back per run (one `idem` process each).
const MAX_KEYS: usize = 40;

/// One event of a key's history: its kind and who recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// `reserved`, `step_committed`, `call_started`, `claimed`, …
    pub kind: String,
    /// The worker (`host:pid` for the shop) or operator, if recorded.
    pub actor: Option<String>,
}

/// What the histories of one run showed.
#[derive(Debug, Default)]
pub struct Resumed {
    /// Keys read back (completed, with no final answer to their client).
    pub read: usize,
    /// Of those, keys claimed by another process and completed by it.
    pub resumed: usize,
    /// Of those, keys whose charge was under way when their process was killed.
    pub mid_call: usize,
    /// The mid-call key with the shortest history: the key, its number of events, and its
    /// history, `kind(actor) > kind > …`.
    pub example: Option<(String, usize, String)>,
}

/// Reads, with `idem keys history --json` (the `idem` binary `idem_bin`), the history of each
/// of `candidates` (purchases the clients got no final answer for and whose key ended
/// completed). Every key that another process claimed must read back as reserved first, a claim by another actor than the
/// reserving one, and the completion last; every such key whose call had started before the
/// claim must show reserved, step committed, call started, claimed (by another actor), call
/// answered, completed, in that order. Fails when no key was resumed mid-call.
pub async fn check_resumed(
    idem_bin: &Path,
    url: &str,
    candidates: &[&OpReport],
) -> Result<Resumed> {
    let mut seen = Resumed::default();
    for op in candidates.iter().take(MAX_KEYS) {
        let events = history(idem_bin, url, &op.user, &op.key).await?;
        seen.read += 1;
        let shown = || format!("{} {}: {}", op.user, op.key, render(&events));
        if !events.iter().any(|e| e.kind == "claimed") {
            // Completed by the process that reserved it (killed before it could answer).
            continue;
        }
        seen.resumed += 1;
        let first = events.first().context("an empty history")?;
        ensure!(first.kind == "reserved", "not reserved first: {}", shown());
        ensure!(
            events.last().map(|e| e.kind.as_str()) == Some("completed"),
            "not completed last: {}",
            shown()
        );
        let reserver = first.actor.clone();
        ensure!(
            events
                .iter()
                .any(|e| e.kind == "claimed" && e.actor != reserver),
            "claimed only by the reserving process: {}",
            shown()
        );
        let started_before_claim = events
            .iter()
            .take_while(|e| e.kind != "claimed")
            .any(|e| e.kind == "call_started");
        if !started_before_claim {
            // Killed before its charge started: resumed, but not mid-call.
            continue;
        }
        ensure!(
            mid_call_in_order(&events),
            "a purchase killed mid-charge and resumed does not read back as reserved, \
             step_committed, call_started, claimed (by another process), call_answered, \
             completed: {}",
            shown()
        );
        seen.mid_call += 1;
        // The shortest such history (one kill, one claim) is the clearest example.
        let shorter = seen
            .example
            .as_ref()
            .is_none_or(|(_, len, _)| events.len() < *len);
        if shorter {
            seen.example = Some((op.key.clone(), events.len(), render(&events)));
        }
    }
    ensure!(
        seen.mid_call > 0,
        "no purchase was killed mid-charge and finished by the restarted shop's worker \
         ({} keys read, {} resumed); with payment latency and SIGKILLs at random moments \
         some charges are under way at each kill",
        seen.read,
        seen.resumed
    );
    Ok(seen)
}

/// Whether `events` holds, in order: reserved, step_committed, call_started, claimed by another
/// actor than the reserving one, call_answered, and ends with completed.
pub fn mid_call_in_order(events: &[Event]) -> bool {
    let Some(reserved) = events.iter().position(|e| e.kind == "reserved") else {
        return false;
    };
    let reserver = &events[reserved].actor;
    let steps: [&dyn Fn(&Event) -> bool; 4] = [
        &|e| e.kind == "step_committed",
        &|e| e.kind == "call_started",
        &|e| e.kind == "claimed" && &e.actor != reserver,
        &|e| e.kind == "call_answered",
    ];
    let mut from = reserved + 1;
    for step in steps {
        match events[from..].iter().position(step) {
            Some(found) => from += found + 1,
            None => return false,
        }
    }
    events.last().map(|e| e.kind.as_str()) == Some("completed")
}

/// `kind(actor) > kind > …`, naming the actor where it changes.
pub fn render(events: &[Event]) -> String {
    let mut actor = None;
    events
        .iter()
        .map(|e| {
            if e.actor.is_some() && e.actor != actor {
                actor = e.actor.clone();
                format!("{}({})", e.kind, e.actor.as_deref().unwrap_or_default())
            } else {
                e.kind.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(" > ")
}

/// `idem --database-url URL keys history SCOPE purchase KEY --json`, oldest event first.
async fn history(idem_bin: &Path, url: &str, scope: &str, key: &str) -> Result<Vec<Event>> {
    let out = tokio::process::Command::new(idem_bin)
        .args([
            "--database-url",
            url,
            "keys",
            "history",
            scope,
            PURCHASE,
            key,
        ])
        .arg("--json")
        .output()
        .await
        .with_context(|| format!("running {}", idem_bin.display()))?;
    ensure!(
        out.status.success(),
        "idem keys history {scope} {PURCHASE} {key} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let json: Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "idem keys history printed no JSON: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })?;
    let events = json.as_array().context("idem keys history: not an array")?;
    events
        .iter()
        .map(|e| {
            Ok(Event {
                kind: e["kind"]
                    .as_str()
                    .context("an event without a kind")?
                    .to_owned(),
                actor: e["actor"].as_str().map(str::to_owned),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(list: &[(&str, &str)]) -> Vec<Event> {
        list.iter()
            .map(|(kind, actor)| Event {
                kind: (*kind).into(),
                actor: Some((*actor).into()),
            })
            .collect()
    }

    #[test]
    fn a_purchase_resumed_mid_call_reads_in_order() {
        let resumed = events(&[
            ("reserved", "h:1"),
            ("step_committed", "h:1"),
            ("call_started", "h:1"),
            ("claimed", "h:2"),
            ("call_started", "h:2"),
            ("call_answered", "h:2"),
            ("completed", "h:2"),
        ]);
        assert!(mid_call_in_order(&resumed));
        assert_eq!(
            render(&resumed),
            "reserved(h:1) > step_committed > call_started > claimed(h:2) > call_started > \
             call_answered > completed"
        );
    }

    #[test]
    fn a_claim_by_the_same_process_or_a_missing_event_is_refused() {
        let same = events(&[
            ("reserved", "h:1"),
            ("step_committed", "h:1"),
            ("call_started", "h:1"),
            ("claimed", "h:1"),
            ("call_answered", "h:1"),
            ("completed", "h:1"),
        ]);
        assert!(!mid_call_in_order(&same));
        let unanswered = events(&[
            ("reserved", "h:1"),
            ("step_committed", "h:1"),
            ("call_started", "h:1"),
            ("claimed", "h:2"),
            ("completed", "h:2"),
        ]);
        assert!(!mid_call_in_order(&unanswered));
        let not_last = events(&[
            ("reserved", "h:1"),
            ("step_committed", "h:1"),
            ("call_started", "h:1"),
            ("claimed", "h:2"),
            ("call_answered", "h:2"),
            ("completed", "h:2"),
            ("released", "h:2"),
        ]);
        assert!(!mid_call_in_order(&not_last));
    }
}
