//! The routes of the service, the keyed ones behind the idempotency layer, and the health and
//! metrics endpoints.

use crate::{
    auth::authenticate,
    db::sql,
    db::StoreConn,
    metrics,
    problem::{Problem, ShopProblem, BODY_LIMIT},
    protect::{layer, policy, purchase_route, KeyedRoute, CREATE_ORDER, SEND_EMAIL},
    routes,
    state::{App, Config, Engine},
    tx::plain_tx,
};
use axum::{
    extract::{DefaultBodyLimit, State},
    http::StatusCode,
    middleware::{from_fn, from_fn_with_state},
    response::{IntoResponse, Response},
    routing::{get, post, MethodRouter},
    Router,
};
use idempotency::{store::CompletionSignal, Idempotency};
use idempotency_http::IdempotencyLayer;
use tower_http::catch_panic::CatchPanicLayer;

/// The router of the service.
pub fn router(app: App, config: &Config) -> Router {
    let plain = from_fn_with_state(app.clone(), plain_tx);
    let purchase = if config.unguarded_purchases {
        post(routes::purchase_unprotected)
    } else {
        durable_purchase(&app, post(routes::purchase))
    };
    let mut user_routes = Router::new()
        .route("/purchases", purchase)
        .route(
            "/orders",
            keyed(&app, CREATE_ORDER, post(routes::create_order)),
        )
        .route("/orders/{id}", get(routes::get_order))
        .route(
            "/orders/{id}/pay",
            post(routes::pay_order).layer(plain.clone()),
        )
        .route(
            "/points/grants",
            post(routes::grant_points).layer(plain.clone()),
        )
        .route("/emails", keyed(&app, SEND_EMAIL, post(routes::send_email)))
        .route("/users/{id}/ledger", get(routes::ledger));
    if config.bench_routes {
        user_routes =
            user_routes.route("/unprotected/purchases", post(routes::purchase_unprotected));
    }
    Router::new()
        .merge(user_routes.layer(from_fn(authenticate)))
        .route("/healthz", get(healthz))
        .route("/metrics", get(render_metrics))
        .fallback(|| async { Problem::not_found("no such route") })
        .method_not_allowed_fallback(|| async {
            Problem::shop(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Method not allowed",
                "this route does not accept that method",
            )
        })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        // A panicking handler answers 500 problem JSON instead of closing the connection.
        .layer(CatchPanicLayer::custom(|_| {
            Problem::panicked().into_response()
        }))
        .with_state(app)
}

async fn healthz(State(app): State<App>) -> Response {
    let ok = match app.db().read().await {
        Ok(mut conn) => {
            let mut c = conn.conn();
            c.execute(sql("SELECT 1")).await.is_ok()
        }
        Err(_) => false,
    };
    if ok {
        axum::Json(serde_json::json!({"status": "ok", "database": app.kind().name()}))
            .into_response()
    } else {
        Problem::shop(
            StatusCode::SERVICE_UNAVAILABLE,
            "unhealthy",
            "Database unreachable",
            "the database does not answer",
        )
        .into_response()
    }
}

async fn render_metrics() -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics::handle().render(),
    )
        .into_response()
}

/// Puts `handler` behind the idempotency layer for the shop's backend; with
/// [`Config::wait_for_in_flight`](crate::state::Config::wait_for_in_flight), a duplicate of a request
/// in flight waits for it (bounded) and gets its stored response instead of a 409.
fn keyed(app: &App, route: KeyedRoute, handler: MethodRouter<App>) -> MethodRouter<App> {
    match app.engine() {
        Engine::Pg(engine) => handler.layer(waiting(app, layer(engine.clone(), route))),
        Engine::Sqlite(engine) => handler.layer(waiting(app, layer(engine.clone(), route))),
        Engine::My(engine) => handler.layer(waiting(app, layer(engine.clone(), route))),
    }
}

/// Puts the purchase handler behind the layer of the durable purchase route, taken from the
/// registry the worker resumes with. A registry without the purchase refuses to start the service.
fn durable_purchase(app: &App, handler: MethodRouter<App>) -> MethodRouter<App> {
    fn on<S: StoreConn>(app: &App, engine: &Idempotency<S>) -> IdempotencyLayer<S> {
        let route = purchase_route(engine.clone(), &app.operations())
            .unwrap_or_else(|error| panic!("the purchase route cannot be built: {error}"));
        waiting(app, policy(route.layer()))
    }
    match app.engine() {
        Engine::Pg(engine) => handler.layer(on(app, engine)),
        Engine::Sqlite(engine) => handler.layer(on(app, engine)),
        Engine::My(engine) => handler.layer(on(app, engine)),
    }
}

fn waiting<S: CompletionSignal>(app: &App, layer: IdempotencyLayer<S>) -> IdempotencyLayer<S> {
    match app.wait_for_in_flight() {
        Some(bound) => layer.with_wait_for_in_flight(bound),
        None => layer,
    }
}
