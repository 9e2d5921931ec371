//! The operator console at `/ui` on the admin server: server-rendered pages over the stores the
//! API uses, for operators who would rather look than read JSON.
//!
//! Pages: `overview` (charts of the decision rollup, [`crate::record::rollup`]), `denials` (the
//! history with the CLI's filters, one denial in full), `recipient` (the quota peek, recent
//! denials, an audited reset), `quarantine` (what is held, replays) and `rules` (the running
//! policy and each rule's counts). `session` owns logging in, the cookie and CSRF.
//!
//! Templates are askama's (`templates/`, HTML-escaped by default: recipient ids and everything
//! else a producer sent are shown as text). The only script is `static/console.js`, which draws
//! the charts with the vendored uPlot (`static/uPlot.*`, MIT, licence beside it); the pages
//! work without it, the charts aside. Nothing is loaded from another origin, and the
//! Content-Security-Policy says so. The console's routes are not part of the JSON API, so
//! they are not in `ROUTES` or `openapi.json`.

mod assets;
mod denials;
mod overview;
mod quarantine;
mod recipient;
mod rules;
mod session;

use std::sync::Arc;

use askama::Template;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use chrono::{DateTime, SecondsFormat, Utc};
use chrono_tz::Tz;

use crate::base::config::AmqpSettings;
use crate::intake::broker::Names;
use crate::ops::service::Ops;

pub use session::{LoginThrottle, Session, Sessions, MAX_LOGIN_DELAY, SESSION_TTL};

/// A page's query string read as `T`; a query that does not read is refused as the console
/// refuses any bad input (a page saying what was wrong), not with axum's plain-text rejection.
pub struct Params<T>(pub T);

impl<S, T> axum::extract::FromRequestParts<S> for Params<T>
where
    S: Send + Sync,
    T: serde::de::DeserializeOwned,
{
    type Rejection = ConsoleError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(t)) => Ok(Params(t)),
            Err(e) => Err(ConsoleError::Input(e.body_text())),
        }
    }
}

/// What the console keeps beside the API's state.
pub struct Console {
    /// Logged-in operators.
    pub sessions: Sessions,
    /// Login attempts per client address, which wait longer the more fail.
    pub login_throttle: LoginThrottle,
    /// How to reach the broker: the quarantine pages open a connection per request, as the CLI
    /// does, named [`BROKER_ROLE`].
    pub amqp: AmqpSettings,
    /// The worker's queue names.
    pub names: Names,
}

impl Console {
    /// The console of a worker with these broker settings and names, with no session yet.
    pub fn new(amqp: AmqpSettings, names: Names) -> Console {
        Console {
            sessions: Sessions::default(),
            login_throttle: LoginThrottle::default(),
            amqp,
            names,
        }
    }
}

/// The connection name of the console's broker connections.
const BROKER_ROLE: &str = "sendquota-console";

/// Pages cannot be framed, run no script but our own, send no referrer (their URLs hold
/// recipient ids) and are not cached (they hold the CSRF token and live data).
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; \
    frame-ancestors 'none'; base-uri 'none'";

/// Failures a console request ends in, each shown as a page with its status.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// The form did not carry the session's CSRF token.
    #[error("this form is out of date or did not come from the console (CSRF token missing or wrong): reload the page and try again")]
    Csrf,
    /// A state change without a live session.
    #[error("your session has ended: log in again")]
    NoSession,
    /// The request asked for something malformed.
    #[error("{0}")]
    Input(String),
    /// What the request named does not exist.
    #[error("{0}")]
    NotFound(String),
    /// A service (Postgres, Redis, RabbitMQ) failed.
    #[error("{0}")]
    Service(String),
    /// The OS's random source failed.
    #[error("no random numbers for a session: {0}")]
    Random(String),
    /// A template failed to render.
    #[error("the page could not be rendered: {0}")]
    Render(String),
}

impl ConsoleError {
    fn status(&self) -> StatusCode {
        match self {
            ConsoleError::Csrf | ConsoleError::NoSession => StatusCode::FORBIDDEN,
            ConsoleError::Input(_) => StatusCode::BAD_REQUEST,
            ConsoleError::NotFound(_) => StatusCode::NOT_FOUND,
            ConsoleError::Service(_) => StatusCode::SERVICE_UNAVAILABLE,
            ConsoleError::Random(_) | ConsoleError::Render(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// The error page.
#[derive(Template)]
#[template(path = "error.html")]
struct ErrorPage<'a> {
    status: u16,
    message: &'a str,
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let status = self.status();
        let message = self.to_string();
        let page = ErrorPage {
            status: status.as_u16(),
            message: &message,
        };
        match page.render() {
            Ok(html) => (status, Html(html)).into_response(),
            Err(_) => (status, message).into_response(),
        }
    }
}

/// A page rendered, or the error page saying it could not be.
fn render(page: &impl Template) -> Response {
    match page.render() {
        Ok(html) => Html(html).into_response(),
        Err(e) => ConsoleError::Render(e.to_string()).into_response(),
    }
}

/// What every logged-in page's frame shows: the navigation, who is logged in, the logout form.
pub struct Layout {
    /// The page's title.
    pub title: &'static str,
    /// The navigation entry to highlight.
    pub active: &'static str,
    /// The token's name.
    pub actor: String,
    /// The session's CSRF token, for the forms on the page.
    pub csrf: String,
}

impl Layout {
    fn new(session: &Session, title: &'static str, active: &'static str) -> Layout {
        Layout {
            title,
            active,
            actor: session.actor.clone(),
            csrf: session.csrf.clone(),
        }
    }
}

/// An instant as the pages print it: RFC 3339 in UTC, to the second.
fn utc(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// An instant in `zone`'s local time, with the zone's abbreviation and offset.
fn local(t: DateTime<Utc>, zone: Tz) -> String {
    t.with_timezone(&zone)
        .format("%Y-%m-%d %H:%M:%S %Z (%:z)")
        .to_string()
}

/// What the console's handlers share: the operator service beneath it, and its sessions and
/// broker access. Derefs to the service, as the admin API's state does.
#[derive(Clone)]
pub struct ConsoleState {
    /// The operator actions' state.
    pub ops: Ops,
    /// The console's sessions and broker access.
    pub console: Arc<Console>,
}

impl std::ops::Deref for ConsoleState {
    type Target = Ops;

    fn deref(&self) -> &Ops {
        &self.ops
    }
}

/// The console's routes under `/ui`, on their own state (served beside the admin API).
pub fn routes(state: ConsoleState) -> Router {
    let pages = Router::new()
        .route("/ui", get(overview::page))
        .route("/ui/denials", get(denials::list))
        .route("/ui/denials/{id}", get(denials::one))
        .route("/ui/recipient", get(recipient::page))
        .route(
            "/ui/recipient/reset",
            get(recipient::confirm_reset).post(recipient::reset),
        )
        .route("/ui/quarantine", get(quarantine::page))
        .route(
            "/ui/quarantine/replay",
            get(quarantine::confirm_replay).post(quarantine::replay),
        )
        .route("/ui/rules", get(rules::page))
        .route("/ui/logout", post(session::logout))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            session::require,
        ));
    Router::new()
        .route("/ui/login", get(session::login_form).post(session::login))
        .route("/ui/static/{file}", get(assets::serve))
        .merge(pages)
        .layer(middleware::from_fn(secure_headers))
        .with_state(state)
}

/// Adds the console's security headers to every response of it.
async fn secure_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    let fixed = [
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    ];
    for (name, value) in fixed {
        headers.insert(name, HeaderValue::from_static(value));
    }
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}
