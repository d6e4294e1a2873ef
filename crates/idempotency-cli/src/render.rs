//! Human tables and JSON for scripts.

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, ContentArrangement, Table};
use idempotency::{
    maintenance::{KeyEvent, KeyStats, PurgeReport, RecoveryReport},
    store::KeyRecord,
};
use serde_json::{json, Value};
use std::time::Duration;

fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(header.iter().map(Cell::new));
    table
}

/// A duration rounded to whole seconds (or milliseconds under a second), as humantime prints it.
pub fn duration(d: Duration) -> String {
    let rounded = if d >= Duration::from_secs(1) {
        Duration::from_secs(d.as_secs())
    } else {
        Duration::from_millis(d.as_millis() as u64)
    };
    humantime::format_duration(rounded).to_string()
}

fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// The stored result: its JSON when it is JSON (as the protocol stores it), else hex.
fn result_json(result: &Option<Vec<u8>>) -> (Value, Value) {
    match result {
        None => (Value::Null, Value::Null),
        Some(bytes) => match serde_json::from_slice::<Value>(bytes) {
            Ok(value) => (value, Value::Null),
            Err(_) => (Value::Null, Value::String(hex::encode(bytes))),
        },
    }
}

/// One row as JSON.
pub fn record_json(record: &KeyRecord) -> Value {
    let (result, result_hex) = result_json(&record.result);
    json!({
        "scope": record.key.scope(),
        "operation": record.key.operation(),
        "key": record.key.key(),
        "state": record.state.as_str(),
        "effects": record.effects.as_str(),
        "fingerprint": record.fingerprint.to_hex(),
        "lease_token": record.lease_token.to_string(),
        "lease_remaining_ms": record.lease_remaining.as_millis() as u64,
        "expired": record.expired,
        "result": result,
        "result_hex": result_hex,
        "reason": record.reason,
        "recovery_attempts": record.recovery_attempts,
        "created_at": record.created_at.to_rfc3339(),
        "updated_at": record.updated_at.to_rfc3339(),
        "lease_until": record.lease_until.to_rfc3339(),
        "expires_at": record.expires_at.to_rfc3339(),
    })
}

fn lease(record: &KeyRecord) -> String {
    if record.lease_expired() {
        "ended".into()
    } else {
        duration(record.lease_remaining)
    }
}

/// `keys list` as a table.
pub fn records_table(records: &[KeyRecord]) -> String {
    let mut t = table(&[
        "SCOPE",
        "OPERATION",
        "KEY",
        "STATE",
        "EFFECTS",
        "CREATED",
        "LEASE LEFT",
        "ATTEMPTS",
        "REASON",
    ]);
    for r in records {
        t.add_row(vec![
            r.key.scope().to_owned(),
            r.key.operation().to_owned(),
            r.key.key().to_owned(),
            r.state.to_string(),
            r.effects.to_string(),
            time(r.created_at),
            lease(r),
            r.recovery_attempts.to_string(),
            r.reason.clone().unwrap_or_default(),
        ]);
    }
    format!("{t}\n{} key(s)", records.len())
}

/// `keys show` as a two-column table.
pub fn record_table(r: &KeyRecord) -> String {
    let result = match &r.result {
        None => String::new(),
        Some(bytes) => match std::str::from_utf8(bytes) {
            Ok(text) => text.to_owned(),
            Err(_) => format!("(hex) {}", hex::encode(bytes)),
        },
    };
    let mut t = table(&["FIELD", "VALUE"]);
    for (field, value) in [
        ("scope", r.key.scope().to_owned()),
        ("operation", r.key.operation().to_owned()),
        ("key", r.key.key().to_owned()),
        ("state", r.state.to_string()),
        ("effects", r.effects.to_string()),
        ("fingerprint", r.fingerprint.to_hex()),
        ("lease token", r.lease_token.to_string()),
        ("lease left", lease(r)),
        ("recovery attempts", r.recovery_attempts.to_string()),
        ("reason", r.reason.clone().unwrap_or_default()),
        ("result", result),
        ("created", time(r.created_at)),
        ("updated", time(r.updated_at)),
        ("lease until", time(r.lease_until)),
        (
            "expires",
            format!(
                "{}{}",
                time(r.expires_at),
                if r.expired { " (expired)" } else { "" }
            ),
        ),
    ] {
        t.add_row(vec![field.to_owned(), value]);
    }
    t.to_string()
}

/// `stats` as JSON.
pub fn stats_json(stats: &KeyStats) -> Value {
    json!({
        "total": stats.total(),
        "counts": stats.counts.iter().map(|c| json!({
            "operation": c.operation,
            "state": c.state.as_str(),
            "count": c.count,
        })).collect::<Vec<_>>(),
        "oldest_pending_age_ms": stats.oldest_pending_age.map(|d| d.as_millis() as u64),
        "expired_leases": stats.expired_leases,
        "purgeable": stats.purgeable,
    })
}

/// `stats` as tables.
pub fn stats_table(stats: &KeyStats) -> String {
    let mut t = table(&["OPERATION", "STATE", "KEYS"]);
    for c in &stats.counts {
        t.add_row(vec![
            c.operation.clone(),
            c.state.to_string(),
            c.count.to_string(),
        ]);
    }
    let oldest = stats
        .oldest_pending_age
        .map_or_else(|| "none pending".to_owned(), duration);
    format!(
        "{t}\ntotal keys:          {}\noldest pending:      {oldest}\nexpired leases:      {}\npurgeable now:       {}",
        stats.total(),
        stats.expired_leases,
        stats.purgeable
    )
}

/// A recovery pass as JSON.
pub fn recovery_json(report: &RecoveryReport) -> Value {
    json!({
        "released": report.released,
        "completed": report.completed,
        "failed": report.failed,
        "parked": report.parked,
        "unknown": report.unknown,
        "skipped": report.skipped,
        "unregistered": report.unregistered,
    })
}

/// A purge as JSON.
pub fn purge_json(report: &PurgeReport) -> Value {
    json!({
        "deleted": report.deleted,
        "batches": report.batches,
        "elapsed_ms": report.elapsed.as_millis() as u64,
    })
}

/// A key's history as JSON, oldest first.
pub fn history_json(events: &[KeyEvent]) -> Value {
    Value::Array(
        events
            .iter()
            .map(|event| {
                json!({
                    "at": event.at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                    "kind": event.kind.as_str(),
                    "actor": event.actor,
                    "detail": event.detail,
                })
            })
            .collect(),
    )
}

/// A key's history as a table (at, kind, actor, detail), oldest first.
pub fn history_table(events: &[KeyEvent]) -> String {
    let mut table = table(&["at", "kind", "actor", "detail"]);
    for event in events {
        table.add_row(vec![
            event.at.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string(),
            event.kind.as_str().to_owned(),
            event.actor.clone().unwrap_or_default(),
            event.detail.clone().unwrap_or_default(),
        ]);
    }
    table.to_string()
}
