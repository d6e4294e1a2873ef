//! The page shell every answer shares, the sign-in page, problem pages and the stylesheet.

use axum::{
    http::{header, StatusCode},
    response::{IntoResponse, Response},
};
use maud::{html, Markup, PreEscaped, DOCTYPE};

/// The stylesheet, served at `/style.css` (the CSP allows no inline style).
pub const STYLE: &str = r#"
:root { font-family: system-ui, sans-serif; color: #1c1c1c; background: #fafafa; }
body { margin: 0 auto; max-width: 72rem; padding: 0 1rem 2rem; }
header { display: flex; gap: 1.5rem; align-items: baseline; border-bottom: 1px solid #ccc; }
header h1 { font-size: 1.2rem; margin-right: auto; }
header form { display: inline; }
table { border-collapse: collapse; width: 100%; margin: 0.5rem 0 1rem; }
th, td { border-bottom: 1px solid #ddd; padding: 0.3rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #eee; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f0f0f0; padding: 0.5rem; overflow-x: auto; max-height: 30rem; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: 0.2rem 1rem; }
dt { font-weight: 600; }
dd { margin: 0; word-break: break-all; }
form.filters, form.action { display: flex; flex-wrap: wrap; gap: 0.5rem; align-items: end; margin: 0.5rem 0; }
form.action { flex-direction: column; align-items: start; border: 1px solid #ccc; padding: 0.75rem; }
label { display: flex; flex-direction: column; font-size: 0.85rem; gap: 0.15rem; }
input, select, textarea, button { font: inherit; padding: 0.25rem 0.4rem; }
textarea { width: 36rem; max-width: 100%; height: 6rem; font-family: monospace; }
.state-needs_review { color: #a40000; font-weight: 600; }
.state-pending { color: #8a5a00; }
#flash { background: #e6f4e6; border: 1px solid #7bb87b; padding: 0.5rem; }
#problem { background: #fbeaea; border: 1px solid #d07b7b; padding: 0.5rem; }
.muted { color: #666; }
a.key-link, td.time, span.at { white-space: nowrap; }
form.action h4 { margin: 0; }
ol#history li { margin-bottom: 0.4rem; }
.actions { display: flex; flex-wrap: wrap; gap: 1rem; }
"#;

/// `GET /style.css`.
pub async fn stylesheet() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE).into_response()
}

/// A page: the document, the navigation (with the sign-out form when `csrf` is given), `body`.
pub fn page(title: &str, csrf: Option<&str>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · idem console" }
                link rel="stylesheet" href="/style.css";
            }
            body {
                header {
                    h1 { "idem console" }
                    @if let Some(csrf) = csrf {
                        nav {
                            a href="/" { "Overview" } " · "
                            a href="/keys" { "Keys" } " · "
                            a href="/keys?state=needs_review" { "Needs review" }
                        }
                        form method="post" action="/sign-out" {
                            input type="hidden" name="csrf" value=(csrf);
                            button id="sign-out" type="submit" { "Sign out" }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// An HTML answer with `status`.
pub fn respond(status: StatusCode, markup: Markup) -> Response {
    (status, markup).into_response()
}

/// The sign-in page, with `problem` above the form.
pub fn sign_in(status: StatusCode, problem: Option<&str>) -> Response {
    let body = html! {
        h2 { "Sign in" }
        @if let Some(problem) = problem {
            p id="problem" { (problem) }
        }
        form id="sign-in" method="post" action="/sign-in" {
            label for="password" { "Password" }
            input type="password" name="password" id="password" autocomplete="current-password";
            " "
            button id="sign-in-submit" type="submit" { "Sign in" }
        }
    };
    respond(status, page("Sign in", None, body))
}

/// A problem page: `status` and what went wrong, in `<p id="problem">`.
pub fn problem(status: StatusCode, text: &str) -> Response {
    let title = status.canonical_reason().unwrap_or("Problem");
    let body = html! {
        h2 { (status.as_u16()) " " (title) }
        p id="problem" { (text) }
        p { a href="/" { "Back to the overview" } }
    };
    respond(status, page(title, None, body))
}

/// `text` as a `<pre>`'s content, kept as is (maud escapes it).
pub fn pre(id: &str, text: &str) -> Markup {
    html! { pre id=(id) { (text) } }
}

/// A non-breaking marker for an empty value.
pub fn none() -> Markup {
    html! { span class="muted" { (PreEscaped("&mdash;")) } }
}

/// A 500 page for a failed read.
pub fn database_error(error: impl std::fmt::Display) -> Response {
    tracing::warn!(%error, "console: the database failed");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        &format!("The database answered with an error: {error}"),
    )
}
