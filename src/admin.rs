//! The admin HTTP API the worker serves: health, readiness, metrics, and under `/v1` (bearer
//! token required) the denial history, quota peek and reset, dry-run checks and rule reloads.
//!
//! The routes are listed once, in [`ROUTES`]; the router is built from the same handlers and
//! a test checks `openapi.json` against that list, so the document cannot drift. The operator
//! console (`/ui`, [`crate::console`]) is served beside them; it is not part of the JSON API
//! and not in the document.

use std::sync::atomic::{AtomicBool, Ordering};
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
use chrono_tz::Tz;
use serde::Deserialize;
use serde_json::json;
use subtle::ConstantTimeEq;

use crate::attributes::Attributes;
use crate::clock::{in_range, parse_instant_or_age, Clock};
use crate::config::AdminToken;
use crate::decision;
use crate::denials::{DenialFilter, DenialStore};
use crate::limiter::Limiter;
use crate::message::SendRequest;
use crate::outcome;
use crate::reload::{ReloadError, Reloader, Source};
use crate::telemetry;

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

/// The OpenAPI document, served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("openapi.json");

/// How long readiness waits for each service.
const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether the worker's consumer is running, and whether the broker blocks its publishing
/// connection; readiness reports both.
#[derive(Debug, Default)]
pub struct Health {
    consuming: AtomicBool,
    blocked: std::sync::Mutex<Option<String>>,
}

impl Health {
    /// Records whether deliveries are being taken.
    pub fn set_consuming(&self, on: bool) {
        self.consuming.store(on, Ordering::SeqCst);
    }

    /// Whether deliveries are being taken.
    pub fn consuming(&self) -> bool {
        self.consuming.load(Ordering::SeqCst)
    }

    /// Records the broker's reason for blocking the publishing connection (`None`: not
    /// blocked). No delivery is taken meanwhile.
    pub fn set_blocked(&self, reason: Option<String>) {
        *self.blocked.lock().unwrap_or_else(|p| p.into_inner()) = reason;
    }

    /// Why the broker blocks the publishing connection, if it does.
    pub fn blocked(&self) -> Option<String> {
        self.blocked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// What the handlers share.
#[derive(Clone)]
pub struct AdminState {
    /// The running rules (each request takes one snapshot) and their reloads.
    pub reloader: Arc<Reloader>,
    /// Quota state.
    pub limiter: Limiter,
    /// The denial history and audit.
    pub denials: DenialStore,
    /// The worker's clock.
    pub clock: Arc<dyn Clock>,
    /// The consumer's state.
    pub health: Arc<Health>,
    /// Accepted bearer tokens (and console logins).
    pub tokens: Arc<Vec<AdminToken>>,
    /// The console's sessions and broker access.
    pub console: Arc<crate::console::Console>,
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
        .merge(crate::console::routes(state.clone()))
        .with_state(state)
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

/// The name of the token `presented` is, if it is one of `tokens`: the `/v1` bearer check and
/// the console's login. Compared against every token in constant time, without stopping at a
/// match, so the time taken says nothing about which token came close.
pub fn token_actor(tokens: &[AdminToken], presented: &str) -> Option<String> {
    let mut actor = None;
    for t in tokens {
        if bool::from(t.token.as_bytes().ct_eq(presented.as_bytes())) {
            actor = Some(t.name.clone());
        }
    }
    actor
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
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

/// Query of `GET /v1/denials`; the console's denial filters come to the same.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenialQuery {
    /// Only this recipient.
    pub recipient: Option<String>,
    /// Only this rule.
    pub rule: Option<String>,
    /// Only this channel.
    pub channel: Option<String>,
    /// Only this category.
    pub category: Option<String>,
    /// Denied at or after: RFC3339 or an age (`7d`).
    pub since: Option<String>,
    /// Denied before: RFC3339 or an age.
    pub until: Option<String>,
    /// Only shadow (true) or only real (false) rows.
    pub shadow: Option<bool>,
    /// Only unchecked dispatches (true) or only the other rows (false).
    pub unchecked: Option<bool>,
    /// Only replayed (true) or unreplayed (false) rows.
    pub replayed: Option<bool>,
    /// The previous page's last id.
    pub after: Option<i64>,
    /// Page size (default 100).
    pub limit: Option<i64>,
}

impl DenialQuery {
    /// The filter this query asks for, ages counted back from `now`; an error for people when
    /// an instant or the limit is out of range.
    pub fn filter(self, now: DateTime<Utc>) -> Result<DenialFilter, String> {
        let instant = |s: Option<String>| s.map(|s| parse_instant_or_age(&s, now)).transpose();
        let (since, until) = match (instant(self.since), instant(self.until)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return Err(e),
        };
        let limit = self.limit.unwrap_or(100);
        if !(1..=crate::denials::MAX_LIMIT).contains(&limit) {
            return Err(format!("limit must be 1 to {}", crate::denials::MAX_LIMIT));
        }
        Ok(DenialFilter {
            recipient: self.recipient,
            rule: self.rule,
            channel: self.channel,
            category: self.category,
            since,
            until,
            shadow: self.shadow,
            unchecked: self.unchecked,
            replayed: self.replayed,
            due_at: None,
            live_at: None,
            after: self.after,
            limit,
        })
    }
}

async fn denials(
    State(state): State<AdminState>,
    query: Result<Query<DenialQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Query(q) = match query {
        Ok(q) => q,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let filter = match q.filter(Utc::now()) {
        Ok(filter) => filter,
        Err(refused) => return error(StatusCode::BAD_REQUEST, refused),
    };
    let limit = filter.limit;
    match state.denials.list(&filter).await {
        Ok(rows) => {
            let next_after = next_after(&rows, limit);
            // A struct, not json!(): that would parse every stored request into a Value.
            #[derive(serde::Serialize)]
            struct Page<'a> {
                denials: Vec<crate::denials::DenialJson<'a>>,
                next_after: Option<i64>,
            }
            let denials = rows.iter().map(|d| d.to_json()).collect();
            Json(Page {
                denials,
                next_after,
            })
            .into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// The cursor of the page after `rows` (a page of `limit` rows, newest first), if there may be
/// one: keyset pagination goes on below the last id.
pub fn next_after(rows: &[crate::denials::Denial], limit: i64) -> Option<i64> {
    (rows.len() as i64 == limit)
        .then(|| rows.last().map(|d| d.id))
        .flatten()
}

/// The instant a route decides at: `?at=` when it is in the supported range (400 otherwise),
/// else the worker's clock.
fn decision_instant(
    at: Option<DateTime<Utc>>,
    state: &AdminState,
) -> Result<DateTime<Utc>, String> {
    match at.map(in_range).transpose() {
        Ok(at) => Ok(at.unwrap_or_else(|| state.clock.now())),
        Err(e) => Err(format!("at: {e}")),
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
    let message = match SendRequest::decode(&body, crate::message::DEFAULT_MAX_BODY_BYTES) {
        Ok(m) => m,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid message: {e}")),
    };
    let at = match decision_instant(q.at, &state) {
        Ok(at) => at,
        Err(refused) => return error(StatusCode::BAD_REQUEST, refused),
    };
    let rules = state.reloader.rules().current();
    let policy = &rules.policy;
    match crate::service::check(&state.limiter, policy, &message, at, false).await {
        Ok(report) => Json(report).into_response(),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// Query of `GET /v1/recipients/{id}/quota`; the console's recipient page asks the same.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeekQuery {
    /// The recipient's zone, for rules counting in local time.
    pub timezone: Option<String>,
    /// A message's channel; any without it.
    pub channel: Option<String>,
    /// A message's category; any without it.
    pub category: Option<String>,
    /// The request's `attributes` as JSON text: rules counting per them are shown.
    pub attributes: Option<String>,
    /// Peek at this instant instead of now.
    pub at: Option<DateTime<Utc>>,
}

/// Every recipient-scope rule's usage for `recipient` as `query` asks, at the instant it
/// names or now: the quota peek of the API and the console. The error is the status and the
/// message to answer with.
pub async fn peek(
    state: &AdminState,
    recipient: &str,
    query: PeekQuery,
) -> Result<(DateTime<Utc>, Vec<outcome::Verdict>), (StatusCode, String)> {
    let bad = |m: String| (StatusCode::BAD_REQUEST, m);
    let zone = match query.timezone.as_deref().map(str::parse::<Tz>).transpose() {
        Ok(z) => z,
        Err(_) => return Err(bad("unknown time zone".to_owned())),
    };
    let at = decision_instant(query.at, state).map_err(bad)?;
    let attributes = match query
        .attributes
        .as_deref()
        .map(Attributes::decode)
        .transpose()
    {
        Ok(a) => a.unwrap_or_default(),
        Err(e) => return Err(bad(e.to_string())),
    };
    let rules = state.reloader.rules().current();
    let peeked = state.limiter.peek(
        &rules.policy,
        recipient,
        zone,
        query.channel.as_deref(),
        query.category.as_deref(),
        &attributes,
        at,
    );
    match peeked.await {
        Ok(verdicts) => Ok((at, verdicts)),
        Err(e) => Err((StatusCode::SERVICE_UNAVAILABLE, e.to_string())),
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
        Err((status, message)) => error(status, message),
    }
}

/// A quota reset that happened, as [`reset_recipient`] reports it.
#[derive(Debug, Clone)]
pub struct Reset {
    /// The rules whose state for the recipient was removed.
    pub rules: Vec<String>,
    /// How many Redis keys existed.
    pub keys_removed: i64,
    /// When (the worker's clock).
    pub reset_at: DateTime<Utc>,
}

/// Why a quota reset failed; each says what became of the quota.
#[derive(Debug, thiserror::Error)]
pub enum ResetError {
    /// The audit row could not be written, so nothing was reset.
    #[error("nothing was reset: the audit row could not be written: {0}")]
    NotAudited(crate::denials::DenialError),
    /// Redis failed the reset (the audit row says `failed`, or stays `pending`).
    #[error("{0}")]
    Redis(crate::limiter::LimiterError),
    /// The quota was reset but its audit row could not be marked done.
    #[error("the quota was reset, but its audit row {audit} stays pending: {error}")]
    AuditPending {
        /// The audit row's id.
        audit: i64,
        /// Why it could not be marked.
        error: crate::denials::DenialError,
    },
}

/// Resets `recipient` in every recipient-scope rule for `actor` (a token's name), audited in
/// `quota_resets`: the row is written first (`pending`), so a reset that cannot be audited
/// does not happen, then marked `done` or `failed`. The API's `DELETE` and the console's reset.
pub async fn reset_recipient(
    state: &AdminState,
    actor: &str,
    recipient: &str,
) -> Result<Reset, ResetError> {
    let running = state.reloader.rules().current();
    let rules = Limiter::reset_rules(&running.policy);
    let at = state.clock.now();
    let audit = state
        .denials
        .begin_reset(recipient, actor, &rules, at)
        .await
        .map_err(ResetError::NotAudited)?;
    let removed = match state.limiter.reset(&running.policy, recipient).await {
        Ok(removed) => removed,
        Err(e) => {
            // Best effort: a row left pending says the same, that the outcome is unknown.
            let _ = state.denials.finish_reset(audit, None).await;
            return Err(ResetError::Redis(e));
        }
    };
    if let Err(error) = state.denials.finish_reset(audit, Some(removed)).await {
        return Err(ResetError::AuditPending { audit, error });
    }
    Ok(Reset {
        rules,
        keys_removed: removed,
        reset_at: at,
    })
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
