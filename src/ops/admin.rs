//! The admin HTTP API the worker serves: health, readiness, metrics, and under `/v1` (bearer
//! token required) the denial history, quota peek and reset, dry-run checks and rule reloads.
//!
//! The routes are listed once, in [`ROUTES`]; the router is built from the same handlers and
//! a test checks `openapi.json` against that list, so the document cannot drift. The operator
//! console (`/ui`, [`crate::ops::console`]) is served beside them; it is not part of the JSON API
//! and not in the document.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::json;

use crate::base::telemetry;
use crate::decide::decision;
use crate::ops::console::{Console, ConsoleState};
use crate::ops::service::{
    decision_instant, next_after, peek, reset_recipient, token_actor, DenialQuery, Ops, PeekError,
    PeekQuery,
};
use crate::request::message::SendRequest;
use crate::rules::reload::{ReloadError, Source};

/// Every route: method and path, as in `openapi.json`.
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
    ("get", "/v1/denials"),
    ("post", "/v1/check"),
    ("get", "/v1/recipients/{id}/quota"),
    ("delete", "/v1/recipients/{id}/quota"),
    ("post", "/v1/rules/reload"),
];

/// The OpenAPI document as committed in `openapi.json`. The one served at `/openapi.json` is
/// built from it, its `Denial` schema from the denial columns ([`crate::ops::openapi`]); a
/// test keeps the two equal.
pub const OPENAPI: &str = crate::ops::openapi::FILE;

/// How long readiness waits for each service.
const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// What the handlers share: the operator service, and the console served beside the API.
#[derive(Clone)]
pub struct AdminState {
    /// The operator actions' state.
    pub ops: Ops,
    /// The console's sessions and broker access.
    pub console: Arc<Console>,
}

impl std::ops::Deref for AdminState {
    type Target = Ops;

    fn deref(&self) -> &Ops {
        &self.ops
    }
}

/// Who made a `/v1` request (the token's name).
#[derive(Clone)]
struct Actor(String);

/// The router with every route of [`ROUTES`].
pub fn router(state: AdminState) -> Router {
    let v1 = Router::new()
        .route("/v1/denials", get(denials))
        .route("/v1/check", post(check))
        .route(
            "/v1/recipients/{id}/quota",
            get(peek_quota).delete(reset_quota),
        )
        .route("/v1/rules/reload", post(reload_rules))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .merge(v1)
        .with_state(state.clone())
        .merge(crate::ops::console::routes(ConsoleState {
            ops: state.ops,
            console: state.console,
        }))
}

/// Serves the API on `listener` until `shutdown` completes. Each request knows its peer's
/// address: the console's login counts attempts per client.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AdminState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(state).into_make_service_with_connect_info::<std::net::SocketAddr>();
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

async fn authenticate(
    State(state): State<AdminState>,
    mut request: Request,
    next: Next,
) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    match token_actor(&state.tokens, presented) {
        Some(name) => {
            request.extensions_mut().insert(Actor(name));
            next.run(request).await
        }
        None => {
            let mut response = error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        }
    }
}

/// What readiness found: the services answer, the consumer runs, the broker does not block.
struct Readiness {
    redis: bool,
    postgres: bool,
    consuming: bool,
    blocked: Option<String>,
}

impl Readiness {
    /// Pings Redis and Postgres (each within [`PING_TIMEOUT`]) and reads the consumer's state.
    async fn check(state: &AdminState) -> Readiness {
        let mut conn = state.limiter.conn().clone();
        let redis = tokio::time::timeout(PING_TIMEOUT, async {
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .is_ok()
        })
        .await
        .unwrap_or(false);
        let postgres = tokio::time::timeout(PING_TIMEOUT, state.denials.ping())
            .await
            .is_ok_and(|r| r.is_ok());
        Readiness {
            redis,
            postgres,
            consuming: state.health.consuming(),
            blocked: state.health.blocked(),
        }
    }

    fn ready(&self) -> bool {
        self.redis && self.postgres && self.consuming && self.blocked.is_none()
    }
}

async fn ready(State(state): State<AdminState>) -> Response {
    let found = Readiness::check(&state).await;
    let ready = found.ready();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "ready": ready, "redis": found.redis, "postgres": found.postgres,
        "consuming": found.consuming, "blocked": found.blocked,
    });
    (status, Json(body)).into_response()
}

/// The metrics, with the readiness gauge measured now as `/readyz` would answer.
async fn metrics(State(state): State<AdminState>) -> Response {
    let ready = Readiness::check(&state).await.ready();
    metrics::gauge!(telemetry::READY).set(if ready { 1.0 } else { 0.0 });
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        telemetry::prometheus().render(),
    )
        .into_response()
}

async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::ops::openapi::document(),
    )
        .into_response()
}

async fn denials(
    State(state): State<AdminState>,
    query: Result<Query<DenialQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Query(q) = match query {
        Ok(q) => q,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let filter = match q.filter(state.clock.now()) {
        Ok(filter) => filter,
        Err(refused) => return error(StatusCode::BAD_REQUEST, refused),
    };
    let limit = filter.limit;
    match state.reads.list(&filter).await {
        Ok(rows) => {
            let next_after = next_after(&rows, limit);
            // A struct, not json!(): that would parse every stored request into a Value.
            #[derive(serde::Serialize)]
            struct Page<'a> {
                denials: &'a [crate::record::denials::Denial],
                next_after: Option<i64>,
            }
            Json(Page {
                denials: &rows,
                next_after,
            })
            .into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// Query of `POST /v1/check`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckQuery {
    at: Option<DateTime<Utc>>,
}

async fn check(
    State(state): State<AdminState>,
    query: Result<Query<CheckQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Response {
    let Query(q) = match query {
        Ok(q) => q,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let message = match SendRequest::decode(&body, crate::request::message::DEFAULT_MAX_BODY_BYTES)
    {
        Ok(m) => m,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid message: {e}")),
    };
    let at = match decision_instant(q.at, &state) {
        Ok(at) => at,
        Err(refused) => return error(StatusCode::BAD_REQUEST, refused),
    };
    let rules = state.reloader.rules().current();
    let policy = &rules.policy;
    match crate::ops::service::check(&state.limiter, policy, &message, at, false).await {
        Ok(report) => Json(report).into_response(),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn peek_quota(
    State(state): State<AdminState>,
    Path(recipient): Path<String>,
    query: Result<Query<PeekQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Query(q) = match query {
        Ok(q) => q,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    match peek(&state, &recipient, q).await {
        Ok((at, verdicts)) => {
            let rules = decision::rules_report(&verdicts);
            Json(json!({ "recipient": recipient, "at": at, "rules": rules })).into_response()
        }
        Err(e @ PeekError::Query(_)) => error(StatusCode::BAD_REQUEST, e.to_string()),
        Err(e @ PeekError::Unavailable(_)) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn reset_quota(
    State(state): State<AdminState>,
    Extension(Actor(actor)): Extension<Actor>,
    Path(recipient): Path<String>,
) -> Response {
    match reset_recipient(&state, &actor, &recipient).await {
        Ok(reset) => Json(json!({
            "recipient": recipient, "rules": reset.rules, "keys_removed": reset.keys_removed,
            "actor": actor, "reset_at": reset.reset_at,
        }))
        .into_response(),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// Reloads the rules from the configuration file the worker started with (the body is not
/// read): 200 with what changed or `unchanged`, 400 with the file's error (the running rules
/// stay), 503 when the change could not be audited (nothing changed).
async fn reload_rules(
    State(state): State<AdminState>,
    Extension(Actor(actor)): Extension<Actor>,
) -> Response {
    match state.reloader.reload(Source::Api(actor)).await {
        Ok(reloaded) => Json(reloaded).into_response(),
        Err(e @ ReloadError::Invalid(_)) => error(StatusCode::BAD_REQUEST, e.to_string()),
        Err(e @ ReloadError::Audit(_)) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}
