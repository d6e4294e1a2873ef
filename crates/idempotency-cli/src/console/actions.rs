//! The actions on keys that need review: resolve one (completed with a result, or failed),
//! hand one back to the resumer, and the same for many after a preview. Each needs a reason
//! and an operator's name, and is fenced on the row the operator saw (`seen`, its
//! `updated_at`): a key that changed meanwhile is left as it is and the answer is 409.

use super::{
    app::App,
    auth::Signed,
    form::Fields,
    layout::{self, database_error, page},
    links::{key_href, time},
};
use axum::{
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Redirect, Response},
    Extension,
};
use chrono::{DateTime, Utc};
use idempotency::{
    maintenance::{self, KeyFilter, OperatorNote, Resolution, ResolveError},
    store::{KeyRecord, KeyState, Maintenance},
    IdempotencyKey,
};
use maud::{html, Markup};

/// The most keys one bulk action touches.
pub const BULK_MAX: u32 = 100;

/// What an operator asked for one key.
#[derive(Debug, Clone)]
enum Action {
    Resolve(Resolution),
    HandBack,
}

/// The forms of a parked key's page: resolve, and hand back.
pub fn forms(record: &KeyRecord, csrf: &str) -> Markup {
    let hidden = html! {
        input type="hidden" name="csrf" value=(csrf);
        input type="hidden" name="scope" value=(record.key.scope());
        input type="hidden" name="operation" value=(record.key.operation());
        input type="hidden" name="key" value=(record.key.key());
        input type="hidden" name="seen" value=(time(record.updated_at));
    };
    html! {
        h3 { "Actions" }
        div class="actions" {
            form id="resolve" method="post" action="/key/resolve" class="action" {
                h4 { "Resolve" }
                (hidden)
                label { "Outcome"
                    select name="resolution" id="resolution" {
                        option value="completed" { "completed (it happened): replay the result below" }
                        option value="failed" { "failed (it did not happen): the key may run again" }
                    }
                }
                label { "Result to replay (JSON, for completed)"
                    textarea name="result" id="result" {}
                }
                (note_fields(""))
                button id="resolve-submit" type="submit" { "Resolve" }
            }
            form id="hand-back" method="post" action="/key/hand-back" class="action" {
                h4 { "Hand back to the resumer" }
                p class="muted" { "It asks the provider again, with the same provider keys." }
                (hidden)
                (note_fields("hand-back-"))
                button id="hand-back-submit" type="submit" { "Hand back" }
            }
        }
    }
}

/// The operator, reason and evidence inputs (ids prefixed by `prefix` but for the resolve form).
fn note_fields(prefix: &str) -> Markup {
    html! {
        label { "Operator" input name="operator" id={ (prefix) "operator" }; }
        label { "Reason" input name="reason" id={ (prefix) "reason" } size="50"; }
        label { "Evidence (optional)" input name="evidence" id={ (prefix) "evidence" } size="50"; }
    }
}

fn read_only() -> Response {
    layout::problem(
        StatusCode::FORBIDDEN,
        "This console is read-only: start it with --allow-actions to act on keys.",
    )
}

fn unprocessable(text: &str) -> Response {
    layout::problem(StatusCode::UNPROCESSABLE_ENTITY, text)
}

fn changed() -> Response {
    layout::problem(
        StatusCode::CONFLICT,
        "The key changed meanwhile (someone or something else acted on it since this page was \
         shown): nothing was written. Open the key again to see its new state.",
    )
}

/// The operator's note from the form (fenced on `seen`), or what is missing (answered with 422).
fn note(fields: &Fields, seen: DateTime<Utc>) -> Result<OperatorNote, String> {
    let (operator, reason) = (fields.text("operator"), fields.text("reason"));
    if reason.is_empty() {
        return Err("A reason is required: say why, for whoever reads the history.".into());
    }
    if operator.is_empty() {
        return Err("The operator's name is required.".into());
    }
    let note = OperatorNote::new(operator, reason).with_seen(seen);
    Ok(match fields.text("evidence") {
        "" => note,
        evidence => note.with_evidence(evidence),
    })
}

fn seen(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// The key and `seen` of a posted form, or what is wrong (answered with 422).
fn target(fields: &Fields) -> Result<(IdempotencyKey, DateTime<Utc>), String> {
    let key = IdempotencyKey::new(
        fields.get("scope").unwrap_or(""),
        fields.get("operation").unwrap_or(""),
        fields.get("key").unwrap_or(""),
    )
    .map_err(|e| format!("invalid key: {e}"))?;
    let seen = seen(fields.text("seen"))
        .ok_or("The form does not say which version of the key it showed.")?;
    Ok((key, seen))
}

/// Applies `action` to `key`, only if its row is still the parked one the operator saw (the
/// note's `seen`); records the operator and the note in the key's history.
async fn act<S: Maintenance>(
    app: &App<S>,
    key: &IdempotencyKey,
    action: &Action,
    note: &OperatorNote,
) -> Result<KeyRecord, ResolveError> {
    match action {
        Action::Resolve(resolution) => {
            maintenance::resolve(&app.store, key, resolution, note, app.settings.retention).await
        }
        Action::HandBack => maintenance::hand_back(&app.store, key, note).await,
    }
}

/// `POST /key/resolve`: completed (with the JSON result to replay) or failed.
pub async fn resolve<S: Maintenance>(
    State(app): State<App<S>>,
    Extension(fields): Extension<Fields>,
) -> Response {
    if !app.settings.allow_actions {
        return read_only();
    }
    let (key, seen) = match target(&fields) {
        Ok(target) => target,
        Err(problem) => return unprocessable(&problem),
    };
    let note = match note(&fields, seen) {
        Ok(note) => note,
        Err(problem) => return unprocessable(&problem),
    };
    let resolution = match fields.text("resolution") {
        "completed" => {
            let result = fields.text("result");
            if let Err(error) = serde_json::from_str::<serde_json::Value>(result) {
                return unprocessable(&format!(
                    "The result to replay must be JSON (replays decode it): {error}"
                ));
            }
            Resolution::Completed(result.as_bytes().to_vec())
        }
        "failed" => Resolution::Failed,
        _ => return unprocessable("The resolution is either completed or failed."),
    };
    answer(
        &key,
        act(&app, &key, &Action::Resolve(resolution), &note).await,
        "resolved",
    )
}

/// `POST /key/hand-back`: the key goes back to the resumer, which asks the provider again.
pub async fn hand_back<S: Maintenance>(
    State(app): State<App<S>>,
    Extension(fields): Extension<Fields>,
) -> Response {
    if !app.settings.allow_actions {
        return read_only();
    }
    let (key, seen) = match target(&fields) {
        Ok(target) => target,
        Err(problem) => return unprocessable(&problem),
    };
    let note = match note(&fields, seen) {
        Ok(note) => note,
        Err(problem) => return unprocessable(&problem),
    };
    answer(
        &key,
        act(&app, &key, &Action::HandBack, &note).await,
        "handed_back",
    )
}

/// A refused action as a page: 409 when the key changed meanwhile (or is no longer parked),
/// 404, 422 for a note the store refuses, 500 for a database failure.
fn refused(error: ResolveError) -> Response {
    match error {
        ResolveError::Stale { .. } | ResolveError::NotParked { .. } => changed(),
        ResolveError::NotFound(key) => {
            layout::problem(StatusCode::NOT_FOUND, &format!("There is no key {key}."))
        }
        ResolveError::Store(error) => database_error(error),
        other => unprocessable(&other.to_string()),
    }
}

/// The answer to one key's action: back to its page (with a flash naming `done`), or refused.
fn answer(key: &IdempotencyKey, acted: Result<KeyRecord, ResolveError>, done: &str) -> Response {
    match acted {
        Ok(_) => Redirect::to(&key_href(key, done)).into_response(),
        Err(error) => refused(error),
    }
}

fn bulk_action(fields: &Fields) -> Option<(Action, &'static str)> {
    match fields.text("action") {
        "failed" => Some((Action::Resolve(Resolution::Failed), "resolve as failed")),
        "hand_back" => Some((Action::HandBack, "hand back to the resumer")),
        _ => None,
    }
}

/// `POST /keys/bulk`: how many parked keys the filter selects (at most [`BULK_MAX`]), which,
/// and a form to confirm the action on exactly those, with a reason.
pub async fn bulk_preview<S: Maintenance>(
    State(app): State<App<S>>,
    Extension(signed): Extension<Signed>,
    Extension(fields): Extension<Fields>,
) -> Response {
    if !app.settings.allow_actions {
        return read_only();
    }
    let Some((_, label)) = bulk_action(&fields) else {
        return unprocessable("The action is either failed or hand_back.");
    };
    let query = super::pages::ListQuery {
        state: KeyState::NeedsReview.as_str().into(),
        operation: fields.text("operation").into(),
        scope: fields.text("scope").into(),
        older_than: fields.text("older_than").into(),
        after: String::new(),
    };
    let filter: KeyFilter = match query.filter() {
        Ok(filter) => filter.with_limit(BULK_MAX),
        Err(problem) => return unprocessable(&problem),
    };
    let records = match app.store.list(&filter).await {
        Ok(records) => records,
        Err(error) => return database_error(error),
    };
    let body = html! {
        h2 { "Preview: " (label) }
        p id="bulk-count" { (records.len()) " keys" }
        @if records.len() as u32 == BULK_MAX {
            p class="muted" { "At most " (BULK_MAX) " keys per action: the oldest are shown; act again for the rest." }
        }
        ul id="bulk-keys" {
            @for record in &records {
                li { a class="key-link" href=(key_href(&record.key, "")) { (record.key.to_string()) } }
            }
        }
        @if !records.is_empty() {
            form id="bulk-confirm" method="post" action="/keys/bulk/confirm" class="action" {
                input type="hidden" name="csrf" value=(signed.csrf);
                input type="hidden" name="action" value=(fields.text("action"));
                @for record in &records {
                    input type="hidden" name="k" value=(serde_json::json!([
                        record.key.scope(), record.key.operation(), record.key.key(), time(record.updated_at)
                    ]).to_string());
                }
                (note_fields("bulk-"))
                button id="bulk-confirm-submit" type="submit" { "Confirm: " (label) " for " (records.len()) " keys" }
            }
        }
    };
    layout::respond(
        StatusCode::OK,
        page("Bulk preview", Some(&signed.csrf), body),
    )
}

/// `POST /keys/bulk/confirm`: the action on exactly the previewed keys, each fenced on the row
/// the preview showed; reports how many were acted on and how many had changed.
pub async fn bulk_confirm<S: Maintenance>(
    State(app): State<App<S>>,
    Extension(signed): Extension<Signed>,
    Extension(fields): Extension<Fields>,
) -> Response {
    if !app.settings.allow_actions {
        return read_only();
    }
    let Some((action, label)) = bulk_action(&fields) else {
        return unprocessable("The action is either failed or hand_back.");
    };
    // Checked once here; each key's action is fenced on its own `seen` below.
    let note = match note(&fields, DateTime::UNIX_EPOCH) {
        Ok(note) => note,
        Err(problem) => return unprocessable(&problem),
    };
    let mut targets = Vec::new();
    for item in fields.all("k") {
        let parsed = serde_json::from_str::<(String, String, String, String)>(item)
            .ok()
            .and_then(|(scope, operation, key, at)| {
                Some((IdempotencyKey::new(scope, operation, key).ok()?, seen(&at)?))
            });
        match parsed {
            Some(target) => targets.push(target),
            None => return unprocessable("A key of the preview could not be read."),
        }
    }
    if targets.is_empty() || targets.len() > BULK_MAX as usize {
        return unprocessable(&format!("Between 1 and {BULK_MAX} keys per bulk action."));
    }
    let (mut done, mut changed) = (0, Vec::new());
    for (key, seen) in &targets {
        match act(&app, key, &action, &note.clone().with_seen(*seen)).await {
            Ok(_) => done += 1,
            Err(
                ResolveError::Stale { .. }
                | ResolveError::NotParked { .. }
                | ResolveError::NotFound(_),
            ) => changed.push(key.clone()),
            // A database failure; or a note the store refuses, the same for every key, so
            // refused at the first, before any write.
            Err(error) => return refused(error),
        }
    }
    let body = html! {
        h2 { "Done: " (label) }
        p id="bulk-done" { "Acted on " span id="bulk-acted" { (done) } " of " (targets.len()) " keys." }
        @if !changed.is_empty() {
            p id="bulk-changed" { (changed.len()) " key(s) had changed meanwhile and were left as they were:" }
            ul { @for key in &changed { li { a href=(key_href(key, "")) { (key.to_string()) } } } }
        }
        p { a href="/keys?state=needs_review" { "Back to the keys needing review" } }
    };
    layout::respond(
        StatusCode::OK,
        page("Bulk action", Some(&signed.csrf), body),
    )
}
