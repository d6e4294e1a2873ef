//! The pages that only read: the overview, the key list with its filters and keyset paging,
//! the keys past their lease, and one key with its request, journal, provider keys and history.

use super::{
    app::App,
    auth::Signed,
    layout::{self, database_error, none, page, pre},
    links::{key_href, time, KeyQuery},
    redact,
};
use axum::{
    extract::{Query, State},
    http::StatusCode,
    response::Response,
    Extension,
};
use chrono::{DateTime, Utc};
use idempotency::{
    durable::provider_key,
    maintenance::{KeyCursor, KeyEvent, KeyFilter},
    store::{KeyRecord, KeyState, Maintenance},
    IdempotencyKey,
};
use maud::{html, Markup};
use serde::{Deserialize, Serialize};

/// Rows per page of the key list.
pub const PAGE_SIZE: u32 = 50;

/// The most events of a key's history shown (the newest).
pub const HISTORY_SHOWN: u32 = 200;

fn state_cell(state: KeyState) -> Markup {
    html! { span class={ "state-" (state.as_str()) } { (state.as_str()) } }
}

/// A table of keys, one `tr.key-row` each, linked to their pages.
fn keys_table(records: &[KeyRecord]) -> Markup {
    html! {
        table id="keys" {
            thead { tr { th { "Key" } th { "Scope" } th { "Operation" } th { "State" } th { "Effects" } th { "Created" } th { "Updated" } th { "Reason" } } }
            tbody {
                @for record in records {
                    tr class="key-row" {
                        td { a class="key-link" href=(key_href(&record.key, "")) { (record.key.key()) } }
                        td { (record.key.scope()) }
                        td { (record.key.operation()) }
                        td { (state_cell(record.state)) }
                        td { (record.effects.as_str()) }
                        td class="time" { (time(record.created_at)) }
                        td class="time" { (time(record.updated_at)) }
                        td { @match &record.reason { Some(reason) => (reason), None => (none()) } }
                    }
                }
            }
        }
    }
}

/// `GET /`: counts by operation and state, the oldest pending and needs-review keys, the keys
/// past their lease.
pub async fn overview<S: Maintenance>(
    State(app): State<App<S>>,
    Extension(signed): Extension<Signed>,
) -> Response {
    let oldest = |state| KeyFilter::default().with_state(state).with_limit(5);
    let read = async {
        let stats = app.store.stats().await?;
        let pending = app.store.list(&oldest(KeyState::Pending)).await?;
        let parked = app.store.list(&oldest(KeyState::NeedsReview)).await?;
        Ok::<_, idempotency::StoreError>((stats, pending, parked))
    };
    let (stats, pending, parked) = match read.await {
        Ok(read) => read,
        Err(error) => return database_error(error),
    };
    let body = html! {
        h2 { "Overview" }
        table id="counts" {
            thead { tr { th { "Operation" } th { "State" } th class="num" { "Keys" } } }
            tbody {
                @for count in &stats.counts {
                    tr {
                        td { (count.operation) }
                        td { (state_cell(count.state)) }
                        td class="num" {
                            a href=(list_href(count.state, &count.operation)) { (count.count) }
                        }
                    }
                }
            }
            tfoot { tr { th colspan="2" { "All" } td class="num" { (stats.total()) } } }
        }
        p {
            "Needs review: " strong id="needs-review-count" { (stats.in_state(KeyState::NeedsReview)) }
            " · purgeable now: " (stats.purgeable)
        }
        section id="oldest" {
            h3 { "Oldest pending keys" }
            @if let Some(age) = stats.oldest_pending_age {
                p { "The oldest is " (humantime::format_duration(std::time::Duration::from_secs(age.as_secs()))) " old (by the database clock)." }
            }
            (oldest_list(&pending))
            h3 { "Oldest keys needing review" }
            (oldest_list(&parked))
        }
        section id="past-lease" {
            h3 { "Past their lease" }
            p {
                "Pending keys whose lease has ended: " strong id="past-lease-count" { (stats.expired_leases) }
                " · " a href="/past-lease" id="past-lease-link" { "show them" }
            }
        }
    };
    layout::respond(StatusCode::OK, page("Overview", Some(&signed.csrf), body))
}

fn list_href(state: KeyState, operation: &str) -> String {
    let query = [("state", state.as_str()), ("operation", operation)];
    format!(
        "/keys?{}",
        serde_urlencoded::to_string(query).unwrap_or_default()
    )
}

fn oldest_list(records: &[KeyRecord]) -> Markup {
    html! {
        @if records.is_empty() {
            p class="muted" { "None." }
        } @else {
            ul {
                @for record in records {
                    li {
                        a class="key-link" href=(key_href(&record.key, "")) { (record.key.to_string()) }
                        " created " (time(record.created_at))
                    }
                }
            }
        }
    }
}

/// `GET /past-lease`: pending keys whose lease has ended, the longest-expired first.
pub async fn past_lease<S: Maintenance>(
    State(app): State<App<S>>,
    Extension(signed): Extension<Signed>,
) -> Response {
    let records = match app.store.expired_leases(PAGE_SIZE).await {
        Ok(records) => records,
        Err(error) => return database_error(error),
    };
    let body = html! {
        h2 { "Pending keys past their lease" }
        p { "The recovery job looks at these (at most " (PAGE_SIZE) " shown, the longest-expired first)." }
        (keys_table(&records))
    };
    layout::respond(
        StatusCode::OK,
        page("Past their lease", Some(&signed.csrf), body),
    )
}

/// The key list's query string.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ListQuery {
    /// A state name, or empty for any.
    #[serde(default)]
    pub state: String,
    /// An operation, or empty for any.
    #[serde(default)]
    pub operation: String,
    /// A scope, or empty for any.
    #[serde(default)]
    pub scope: String,
    /// A minimum age (humantime, e.g. `5m`), or empty.
    #[serde(default)]
    pub older_than: String,
    /// The keyset cursor of the page before, or empty for the first page.
    #[serde(default)]
    pub after: String,
}

impl ListQuery {
    /// The filter these fields name (without the cursor and the limit), or what is wrong.
    pub fn filter(&self) -> Result<KeyFilter, String> {
        let mut filter = KeyFilter::default();
        if !self.state.trim().is_empty() {
            let state = self
                .state
                .trim()
                .parse::<KeyState>()
                .map_err(|_| format!("unknown state {:?}", self.state))?;
            filter = filter.with_state(state);
        }
        if !self.operation.trim().is_empty() {
            filter = filter.with_operation(self.operation.trim());
        }
        if !self.scope.trim().is_empty() {
            filter = filter.with_scope(self.scope.trim());
        }
        if !self.older_than.trim().is_empty() {
            let age = humantime::parse_duration(self.older_than.trim())
                .map_err(|e| format!("older than {:?}: {e}", self.older_than))?;
            filter = filter.with_older_than(age);
        }
        Ok(filter)
    }

    fn cursor(&self) -> Result<Option<KeyCursor>, String> {
        if self.after.is_empty() {
            return Ok(None);
        }
        let bad = || "the page cursor is not one this console made".to_owned();
        let (time, scope, operation, key): (String, String, String, String) =
            serde_json::from_str(&self.after).map_err(|_| bad())?;
        let time = DateTime::parse_from_rfc3339(&time).map_err(|_| bad())?;
        let key = IdempotencyKey::new(scope, operation, key).map_err(|_| bad())?;
        Ok(Some(KeyCursor::new(time.with_timezone(&Utc), key)))
    }

    fn next_href(&self, last: &KeyRecord) -> String {
        let key = &last.key;
        let after = serde_json::json!([
            time(last.created_at),
            key.scope(),
            key.operation(),
            key.key()
        ]);
        let next = ListQuery {
            after: after.to_string(),
            ..self.clone()
        };
        format!(
            "/keys?{}",
            serde_urlencoded::to_string(next).unwrap_or_default()
        )
    }
}

/// `GET /keys`: the keys matching the filters, oldest first, a page at a time (keyset paging:
/// `after` is the last row of the page before).
pub async fn keys<S: Maintenance>(
    State(app): State<App<S>>,
    Extension(signed): Extension<Signed>,
    Query(query): Query<ListQuery>,
) -> Response {
    let filter = match (query.filter(), query.cursor()) {
        (Ok(filter), Ok(cursor)) => {
            let filter = filter.with_limit(PAGE_SIZE + 1);
            match cursor {
                Some(cursor) => filter.with_after(cursor),
                None => filter,
            }
        }
        (Err(problem), _) | (_, Err(problem)) => {
            return layout::problem(StatusCode::UNPROCESSABLE_ENTITY, &problem)
        }
    };
    let mut records = match app.store.list(&filter).await {
        Ok(records) => records,
        Err(error) => return database_error(error),
    };
    let more = records.len() > PAGE_SIZE as usize;
    records.truncate(PAGE_SIZE as usize);
    let bulk = app.settings.allow_actions && filter.state() == Some(KeyState::NeedsReview);
    let body = html! {
        h2 { "Keys" }
        (filters_form(&query))
        p id="shown-count" { (records.len()) " key(s) shown" @if !query.after.is_empty() { " (a later page)" } }
        (keys_table(&records))
        @if more {
            @if let Some(last) = records.last() {
                p { a id="next-page" href=(query.next_href(last)) { "Next page" } }
            }
        }
        @if bulk && !records.is_empty() {
            (bulk_form(&query, &signed.csrf))
        }
    };
    layout::respond(StatusCode::OK, page("Keys", Some(&signed.csrf), body))
}

fn filters_form(query: &ListQuery) -> Markup {
    let states = ["", "pending", "completed", "needs_review", "failed"];
    html! {
        form id="filters" method="get" action="/keys" class="filters" {
            label { "State"
                select name="state" id="filter-state" {
                    @for state in states {
                        option value=(state) selected[query.state == state] {
                            @if state.is_empty() { "any" } @else { (state) }
                        }
                    }
                }
            }
            label { "Operation" input name="operation" id="filter-operation" value=(query.operation); }
            label { "Scope" input name="scope" id="filter-scope" value=(query.scope); }
            label { "Older than" input name="older_than" id="filter-older-than" value=(query.older_than) placeholder="e.g. 5m"; }
            button id="filter-submit" type="submit" { "Filter" }
        }
    }
}

fn bulk_form(query: &ListQuery, csrf: &str) -> Markup {
    html! {
        form id="bulk" method="post" action="/keys/bulk" class="action" {
            h3 { "Act on every key of this filter" }
            input type="hidden" name="csrf" value=(csrf);
            input type="hidden" name="operation" value=(query.operation);
            input type="hidden" name="scope" value=(query.scope);
            input type="hidden" name="older_than" value=(query.older_than);
            label { "Action"
                select name="action" id="bulk-action" {
                    option value="failed" { "resolve as failed (did not happen)" }
                    option value="hand_back" { "hand back to the resumer (ask the provider again)" }
                }
            }
            button id="bulk-submit" type="submit" { "Preview" }
        }
    }
}

/// `GET /key`: one key with its row, stored request (masked and bounded), journal, provider
/// keys and history, and the actions when it needs review and actions are allowed.
pub async fn key<S: Maintenance>(
    State(app): State<App<S>>,
    Extension(signed): Extension<Signed>,
    Query(query): Query<KeyQuery>,
) -> Response {
    let key = match IdempotencyKey::new(&query.scope, &query.operation, &query.key) {
        Ok(key) => key,
        Err(error) => {
            return layout::problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                &format!("invalid key: {error}"),
            )
        }
    };
    let read = async {
        let record = app.store.find(&key).await?;
        let events = app.store.history(&key, HISTORY_SHOWN).await?;
        Ok::<_, idempotency::StoreError>(record.map(|record| (record, events)))
    };
    let (record, events) = match read.await {
        Ok(Some(read)) => read,
        Ok(None) => {
            return layout::problem(StatusCode::NOT_FOUND, &format!("There is no key {key}."))
        }
        Err(error) => return database_error(error),
    };
    let fields = &app.settings.redact;
    let actions = app.settings.allow_actions && record.state == KeyState::NeedsReview;
    let body = html! {
        h2 { "Key " code { (key.key()) } }
        @if let Some(flash) = flash(&query.done) {
            p id="flash" { (flash) }
        }
        (row(&record, fields))
        h3 { "Stored request" }
        @match &record.request {
            Some(bytes) => (pre("key-request", &redact::shown(bytes, fields))),
            None => pre id="key-request" class="muted" { "(none stored)" },
        }
        h3 { "Journal of steps" }
        @match &record.progress {
            Some(bytes) => (pre("key-journal", &redact::shown(bytes, fields))),
            None => pre id="key-journal" class="muted" { "(no steps recorded)" },
        }
        h3 { "Provider keys" }
        (provider_keys(&record))
        h3 { "History" }
        (history(&events))
        @if actions {
            (super::actions::forms(&record, &signed.csrf))
        }
    };
    layout::respond(
        StatusCode::OK,
        page(&key.to_string(), Some(&signed.csrf), body),
    )
}

/// A key's history, oldest first: time, what happened, who, the particulars.
fn history(events: &[KeyEvent]) -> Markup {
    html! {
        ol id="history" {
            @for event in events {
                li class="event" data-kind=(event.kind.as_str()) {
                    span class="at" { (time(event.at)) } " "
                    strong class="kind" { (event.kind.as_str()) }
                    @if let Some(actor) = &event.actor { " by " span class="actor" { (actor) } }
                    @if let Some(detail) = &event.detail { ": " span class="detail" { (detail) } }
                }
            }
        }
        @if events.is_empty() {
            p class="muted" { "No events recorded." }
        } @else if events.len() as u32 == HISTORY_SHOWN {
            p class="muted" { "The newest " (HISTORY_SHOWN) " events are shown." }
        }
    }
}

fn flash(done: &str) -> Option<&'static str> {
    match done {
        "resolved" => Some("Resolved: the key's new state and the history entry are below."),
        "handed_back" => Some("Handed back: the resumer will ask the provider again."),
        _ => None,
    }
}

/// The row's fields (the stored result masked and bounded like the request).
fn row(record: &KeyRecord, fields: &[String]) -> Markup {
    html! {
        dl {
            dt { "Scope" } dd id="key-scope" { (record.key.scope()) }
            dt { "Operation" } dd id="key-operation" { (record.key.operation()) }
            dt { "Key" } dd id="key-key" { (record.key.key()) }
            dt { "State" } dd id="key-state" class={ "state-" (record.state.as_str()) } { (record.state.as_str()) }
            dt { "Effects" } dd id="key-effects" { (record.effects.as_str()) }
            dt { "Reason" } dd id="key-reason" { @match &record.reason { Some(r) => (r), None => (none()) } }
            dt { "Recovery point" } dd id="key-recovery-point" { @match &record.recovery_point { Some(p) => (p), None => (none()) } }
            dt { "Unknown answers" } dd id="key-attempts" { (record.recovery_attempts) }
            dt { "Created" } dd id="key-created" { (time(record.created_at)) }
            dt { "Updated" } dd id="key-updated" { (time(record.updated_at)) }
            dt { "Lease until" } dd id="key-lease-until" { (time(record.lease_until)) @if record.lease_expired() { " (ended)" } }
            dt { "Kept until" } dd id="key-expires" { (time(record.expires_at)) }
            dt { "Fingerprint" } dd id="key-fingerprint" { code { (record.fingerprint.to_hex()) } }
            dt { "Result" } dd id="key-result" {
                @match &record.result { Some(bytes) => pre { (redact::shown(bytes, fields)) }, None => (none()) }
            }
        }
    }
}

/// The steps named in the journal (`done` and `started`), with the key a provider gets for
/// each of them were it an outside call ([`provider_key`]).
fn provider_keys(record: &KeyRecord) -> Markup {
    let mut steps: Vec<String> = Vec::new();
    if let Some(journal) = record
        .progress
        .as_deref()
        .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(bytes).ok())
    {
        if let Some(done) = journal.get("done").and_then(|d| d.as_object()) {
            steps.extend(done.keys().cloned());
        }
        if let Some(started) = journal.get("started").and_then(|s| s.as_array()) {
            steps.extend(started.iter().filter_map(|s| s.as_str().map(str::to_owned)));
        }
    }
    steps.sort();
    steps.dedup();
    html! {
        ul id="provider-keys" {
            @for step in &steps {
                li { code class="step" { (step) } " → " code class="provider-key" { (provider_key(&record.key, step)) } }
            }
        }
        @if steps.is_empty() {
            p class="muted" { "No steps recorded." }
        } @else {
            p class="muted" { "An outside call made in a step sends its provider this key (local steps send none)." }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ListQuery;
    use chrono::{TimeZone, Utc};
    use idempotency::{
        store::{KeyRecord, KeyState, LeaseToken},
        Effects, Fingerprint, IdempotencyKey,
    };

    #[test]
    fn filters_and_the_cursor_round_trip() {
        let query = ListQuery {
            state: "needs_review".into(),
            older_than: "5m".into(),
            ..ListQuery::default()
        };
        let filter = query.filter().unwrap();
        assert_eq!(filter.state(), Some(KeyState::NeedsReview));
        assert_eq!(filter.older_than().unwrap().as_secs(), 300);
        assert!(ListQuery {
            state: "done".into(),
            ..ListQuery::default()
        }
        .filter()
        .is_err());
        assert!(ListQuery {
            older_than: "soon".into(),
            ..ListQuery::default()
        }
        .filter()
        .is_err());

        let key = IdempotencyKey::new("a&b", "op=1", "k \"2\"").unwrap();
        let mut last = KeyRecord::new(
            key.clone(),
            KeyState::NeedsReview,
            Effects::External,
            Fingerprint::of_bytes(b"r"),
            LeaseToken::new(),
        );
        last.created_at = Utc.timestamp_micros(1_765_000_000_123_456).unwrap();
        let href = query.next_href(&last);
        let next: ListQuery =
            serde_urlencoded::from_str(href.strip_prefix("/keys?").unwrap()).unwrap();
        assert_eq!(next.state, "needs_review");
        let cursor = next.cursor().unwrap().unwrap();
        assert_eq!((cursor.created_at(), cursor.key()), (last.created_at, &key));
        let forged = ListQuery {
            after: "[1,2]".into(),
            ..ListQuery::default()
        };
        assert!(forged.cursor().is_err());
    }
}
