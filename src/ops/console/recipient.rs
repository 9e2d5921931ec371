//! One recipient: every recipient-scope rule's usage now (the API's quota peek), recent
//! denials, and a quota reset after a confirmation step, audited as the API's `DELETE` is
//! (the same code: [`crate::ops::service::reset_recipient`]).

use askama::Template;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Form};
use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde::Deserialize;

use super::denials::Row;
use super::ConsoleState;
use super::{local, render, utc, ConsoleError, Layout, Params, Session};
use crate::decide::limiter::Limiter;
use crate::decide::outcome::Verdict;
use crate::ops::service::PeekQuery;
use crate::record::denials::{Denial, DenialFilter};

/// Recent denials shown: enough to see a pattern; the denials page has the rest.
const RECENT: i64 = 20;

/// The page's query: the recipient and, optionally, their zone (for rules counting in local
/// time). The id is taken exactly as given, spaces and all, as the API and the worker take it:
/// `" alice"` is another recipient than `alice`, and a page or reset of one must never reach
/// the other.
#[derive(Debug, Default, Deserialize)]
pub struct Which {
    #[serde(default)]
    id: String,
    #[serde(default)]
    timezone: String,
}

/// One rule's usage, formatted.
struct Usage {
    rule: String,
    kind: String,
    allowed: bool,
    remaining: String,
    retry_after_utc: String,
    retry_after_local: String,
}

/// The recipient page.
#[derive(Template)]
#[template(path = "recipient.html")]
struct Page {
    layout: Layout,
    id: String,
    timezone: String,
    zone: String,
    at: String,
    usage: Vec<Usage>,
    denials: Vec<Row>,
}

/// `GET /ui/recipient?id=&timezone=`.
pub async fn page(
    State(state): State<ConsoleState>,
    Extension(session): Extension<Session>,
    Params(which): Params<Which>,
) -> Response {
    let layout = Layout::new(&session, "Recipient", "recipient");
    let id = which.id;
    let timezone = which.timezone.trim().to_owned();
    if id.is_empty() {
        return render(&Page {
            layout,
            id,
            timezone,
            zone: String::new(),
            at: String::new(),
            usage: vec![],
            denials: vec![],
        });
    }
    let default_zone = state.reloader.rules().current().policy.default_zone;
    let zone: Tz = if timezone.is_empty() {
        default_zone
    } else {
        match timezone.parse() {
            Ok(z) => z,
            Err(_) => {
                return ConsoleError::Input(format!("unknown time zone {timezone:?}"))
                    .into_response()
            }
        }
    };
    let (at, verdicts, recent) = match usage_and_recent(&state, &id, &timezone).await {
        Ok(found) => found,
        Err(e) => return e.into_response(),
    };
    render(&Page {
        layout,
        id,
        timezone,
        zone: zone.name().to_owned(),
        at: utc(at),
        usage: verdicts.iter().map(|v| Usage::of(v, zone)).collect(),
        denials: recent
            .into_iter()
            .map(|d| Row::of(d, default_zone))
            .collect(),
    })
}

/// The recipient's usage (when it was peeked, and every rule's verdict) and recent denials,
/// asked at once.
async fn usage_and_recent(
    state: &ConsoleState,
    id: &str,
    timezone: &str,
) -> Result<(DateTime<Utc>, Vec<Verdict>, Vec<Denial>), ConsoleError> {
    let peek = PeekQuery {
        timezone: (!timezone.is_empty()).then(|| timezone.to_owned()),
        ..PeekQuery::default()
    };
    let filter = DenialFilter {
        recipient: Some(id.to_owned()),
        limit: RECENT,
        ..DenialFilter::default()
    };
    let (peeked, recent) = tokio::join!(
        crate::ops::service::peek(state, id, peek),
        state.reads.list(&filter)
    );
    let (at, verdicts) = peeked.map_err(|e| ConsoleError::Service(e.to_string()))?;
    let recent = recent.map_err(|e| ConsoleError::Service(e.to_string()))?;
    Ok((at, verdicts, recent))
}

impl Usage {
    /// `verdict`'s usage, its instants in UTC and in the recipient's `zone`.
    fn of(v: &Verdict, zone: Tz) -> Usage {
        Usage {
            rule: v.rule.clone(),
            kind: v.kind.to_owned(),
            allowed: v.allowed,
            remaining: v.remaining.map(|r| r.to_string()).unwrap_or_default(),
            retry_after_utc: v.retry_after.map(utc).unwrap_or_default(),
            retry_after_local: v.retry_after.map(|t| local(t, zone)).unwrap_or_default(),
        }
    }
}

/// The confirmation page of a reset.
#[derive(Template)]
#[template(path = "confirm_reset.html")]
struct Confirm {
    layout: Layout,
    id: String,
    rules: Vec<String>,
}

/// `GET /ui/recipient/reset?id=`: what a reset would clear, and the button that does it.
pub async fn confirm_reset(
    State(state): State<ConsoleState>,
    Extension(session): Extension<Session>,
    Params(which): Params<Which>,
) -> Response {
    let id = which.id;
    if id.is_empty() {
        return ConsoleError::Input("which recipient?".to_owned()).into_response();
    }
    let rules = Limiter::reset_rules(&state.reloader.rules().current().policy);
    render(&Confirm {
        layout: Layout::new(&session, "Reset a quota", "recipient"),
        id,
        rules,
    })
}

/// The reset form's fields.
#[derive(Deserialize)]
pub struct ResetForm {
    #[serde(default)]
    id: String,
    #[serde(default)]
    csrf: String,
}

/// What a reset did.
#[derive(Template)]
#[template(path = "reset_done.html")]
struct Done {
    layout: Layout,
    id: String,
    rules: Vec<String>,
    keys_removed: i64,
    reset_at: String,
}

/// `POST /ui/recipient/reset`: resets the quota, audited under the session's token name.
pub async fn reset(
    State(state): State<ConsoleState>,
    Extension(session): Extension<Session>,
    Form(form): Form<ResetForm>,
) -> Response {
    if let Err(e) = session.check_csrf(&form.csrf) {
        return e.into_response();
    }
    let id = form.id.as_str();
    if id.is_empty() {
        return ConsoleError::Input("which recipient?".to_owned()).into_response();
    }
    match crate::ops::service::reset_recipient(&state, &session.actor, id).await {
        Ok(reset) => render(&Done {
            layout: Layout::new(&session, "Quota reset", "recipient"),
            id: id.to_owned(),
            rules: reset.rules,
            keys_removed: reset.keys_removed,
            reset_at: utc(reset.reset_at),
        }),
        Err(e) => ConsoleError::Service(e.to_string()).into_response(),
    }
}
