//! The denial history: the CLI's filters, keyset pagination (the store's `after` cursor), and
//! one denial in full with its request, its rule and when it could be sent, in UTC and in the
//! recipient's zone.

use askama::Template;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use chrono_tz::Tz;
use serde::Deserialize;

use super::ConsoleState;
use super::{local, render, utc, ConsoleError, Layout, Params, Session};
use crate::ops::service::DenialQuery;
use crate::record::denials::columns::{Console, COLUMNS};
use crate::record::denials::Denial;

/// The page size when the form asks for none: a screenful, and quick to render.
const PAGE: i64 = 50;

/// The filter form's fields, as a browser sends them: every field present, blank meaning
/// "any". Turned into the API's [`DenialQuery`], so both read filters alike.
#[derive(Debug, Default, Deserialize)]
pub struct Filters {
    #[serde(default)]
    recipient: String,
    #[serde(default)]
    rule: String,
    #[serde(default)]
    channel: String,
    #[serde(default)]
    category: String,
    #[serde(default)]
    since: String,
    #[serde(default)]
    until: String,
    #[serde(default)]
    shadow: String,
    #[serde(default)]
    unchecked: String,
    #[serde(default)]
    replayed: String,
    #[serde(default)]
    after: String,
    #[serde(default)]
    limit: String,
}

/// An empty field is no filter; any other names exactly what it holds. Ids (recipients,
/// rules, channels, categories) are compared as given, spaces and all, as the API and the CLI
/// compare them: `" alice"` finds the denials of `" alice"`, not those of `alice`.
fn exact(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

/// A blank field is no filter: instants, ages and numbers, typed by people, are read without
/// the spaces around them.
fn given(s: &str) -> Option<String> {
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_owned())
}

fn flag(name: &str, s: &str) -> Result<Option<bool>, ConsoleError> {
    match s.trim() {
        "" => Ok(None),
        "true" => Ok(Some(true)),
        "false" => Ok(Some(false)),
        other => Err(ConsoleError::Input(format!(
            "{name} must be true, false or blank, not {other:?}"
        ))),
    }
}

fn number(name: &str, s: &str) -> Result<Option<i64>, ConsoleError> {
    given(s)
        .map(|n| {
            n.parse()
                .map_err(|_| ConsoleError::Input(format!("{name} must be a whole number")))
        })
        .transpose()
}

impl Filters {
    fn query(&self) -> Result<DenialQuery, ConsoleError> {
        Ok(DenialQuery {
            recipient: exact(&self.recipient),
            rule: exact(&self.rule),
            channel: exact(&self.channel),
            category: exact(&self.category),
            since: given(&self.since),
            until: given(&self.until),
            shadow: flag("shadow", &self.shadow)?,
            unchecked: flag("unchecked", &self.unchecked)?,
            replayed: flag("replayed", &self.replayed)?,
            after: number("after", &self.after)?,
            limit: Some(number("limit", &self.limit)?.unwrap_or(PAGE)),
        })
    }

    /// The query string of these filters with `after` set to `after`: the next page's link.
    /// Every field is carried as it was given, so an id keeps its spaces from page to page.
    fn with_after(&self, after: Option<i64>) -> String {
        let fields = [
            ("recipient", self.recipient.as_str()),
            ("rule", &self.rule),
            ("channel", &self.channel),
            ("category", &self.category),
            ("since", &self.since),
            ("until", &self.until),
            ("shadow", &self.shadow),
            ("unchecked", &self.unchecked),
            ("replayed", &self.replayed),
            ("limit", &self.limit),
        ];
        let after = after.map(|a| a.to_string()).unwrap_or_default();
        fields
            .into_iter()
            .chain([("after", after.as_str())])
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| format!("{k}={}", encode(v)))
            .collect::<Vec<_>>()
            .join("&")
    }
}

/// `s` percent-encoded for a query string.
fn encode(s: &str) -> String {
    use std::fmt::Write;
    s.bytes().fold(String::new(), |mut out, b| {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
        out
    })
}

/// A denial as the pages show it: the row, and its instants formatted, retry_after also in
/// the recipient's zone (see [`zone_of`]).
pub struct Row {
    /// The denial.
    pub d: Denial,
    zone: Tz,
}

impl Row {
    /// The row of `d`, whose recipient's zone is `default_zone` unless its request names one.
    pub fn of(d: Denial, default_zone: Tz) -> Row {
        let zone = zone_of(&d, default_zone);
        Row { d, zone }
    }

    /// The rule, marked when the row is not a denial of a message that went unsent.
    pub fn rule(&self) -> String {
        if self.d.shadow {
            format!("{} (shadow)", self.d.rule)
        } else if self.d.unchecked {
            format!("{} (unchecked)", self.d.rule)
        } else {
            self.d.rule.clone()
        }
    }

    /// When it was denied, in UTC.
    pub fn denied_at(&self) -> String {
        utc(self.d.denied_at)
    }

    /// When it could be sent, in UTC.
    pub fn retry_after_utc(&self) -> String {
        self.d.retry_after.map(utc).unwrap_or_default()
    }

    /// When it could be sent, in the recipient's zone.
    pub fn retry_after_local(&self) -> String {
        self.d
            .retry_after
            .map(|t| local(t, self.zone))
            .unwrap_or_default()
    }

    /// When it was replayed, in UTC.
    pub fn replayed_at(&self) -> String {
        self.d.replayed_at.map(utc).unwrap_or_default()
    }

    /// The recipient's zone's name.
    pub fn zone(&self) -> &str {
        self.zone.name()
    }

    /// The columns the denial's page lists after those its template shows in places of their
    /// own ([`Console::Listed`]), name and cell: a new column is on the page as it is added.
    pub fn listed(&self) -> Vec<(&'static str, String)> {
        COLUMNS
            .iter()
            .filter(|c| c.console == Console::Listed)
            .map(|c| (c.name, c.cell(&self.d).into_owned()))
            .collect()
    }
}

/// The recipient's zone: the request's `timezone`, else the policy's default zone (as the
/// worker decided it).
pub fn zone_of(d: &Denial, default_zone: Tz) -> Tz {
    d.message
        .value()
        .get("timezone")
        .and_then(|z| z.as_str())
        .and_then(|z| z.parse().ok())
        .unwrap_or(default_zone)
}

/// The list page.
#[derive(Template)]
#[template(path = "denials.html")]
struct List {
    layout: Layout,
    filters: Filters,
    /// The yes/no filters: name and the value chosen.
    flags: Vec<(&'static str, String)>,
    rules: Vec<String>,
    rows: Vec<Row>,
    next: Option<String>,
    first: Option<String>,
}

/// `GET /ui/denials`.
pub async fn list(
    State(state): State<ConsoleState>,
    Extension(session): Extension<Session>,
    Params(filters): Params<Filters>,
) -> Response {
    let filter = match filters
        .query()
        .and_then(|q| q.filter(state.clock.now()).map_err(ConsoleError::Input))
    {
        Ok(filter) => filter,
        Err(e) => return e.into_response(),
    };
    let rows = match state.reads.list(&filter).await {
        Ok(rows) => rows,
        Err(e) => return ConsoleError::Service(e.to_string()).into_response(),
    };
    let running = state.reloader.rules().current();
    let default_zone = running.policy.default_zone;
    let next =
        crate::ops::service::next_after(&rows, filter.limit).map(|a| filters.with_after(Some(a)));
    let first = filter.after.map(|_| filters.with_after(None));
    render(&List {
        layout: Layout::new(&session, "Denials", "denials"),
        rules: running
            .policy
            .rules
            .iter()
            .map(|r| r.name.clone())
            .collect(),
        rows: rows.into_iter().map(|d| Row::of(d, default_zone)).collect(),
        flags: vec![
            ("shadow", filters.shadow.clone()),
            ("unchecked", filters.unchecked.clone()),
            ("replayed", filters.replayed.clone()),
        ],
        filters,
        next,
        first,
    })
}

/// One denial's page.
#[derive(Template)]
#[template(path = "denial.html")]
struct One {
    layout: Layout,
    row: Row,
    /// The rule as the running policy has it (TOML), if it still has it.
    rule_now: Option<String>,
}

/// `GET /ui/denials/{id}`.
pub async fn one(
    State(state): State<ConsoleState>,
    Extension(session): Extension<Session>,
    Path(id): Path<String>,
) -> Response {
    let Ok(id) = id.parse::<i64>() else {
        return ConsoleError::Input("a denial id is a whole number".to_owned()).into_response();
    };
    let denial = match state.reads.get(id).await {
        Ok(Some(d)) => d,
        Ok(None) => {
            return ConsoleError::NotFound(format!("there is no denial {id}")).into_response()
        }
        Err(e) => return ConsoleError::Service(e.to_string()).into_response(),
    };
    let running = state.reloader.rules().current();
    let rule_now = running
        .policy
        .rule(&denial.rule)
        .and_then(|r| toml::to_string(r).ok());
    render(&One {
        layout: Layout::new(&session, "Denial", "denials"),
        row: Row::of(denial, running.policy.default_zone),
        rule_now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_page_keeps_the_filters_encoded_and_moves_the_cursor() {
        let filters = Filters {
            recipient: "a b&c=<d>".to_owned(),
            rule: "headline".to_owned(),
            shadow: "false".to_owned(),
            after: "90".to_owned(),
            ..Filters::default()
        };
        assert_eq!(
            filters.with_after(Some(42)),
            "recipient=a%20b%26c%3D%3Cd%3E&rule=headline&shadow=false&after=42"
        );
        assert_eq!(
            filters.with_after(None),
            "recipient=a%20b%26c%3D%3Cd%3E&rule=headline&shadow=false"
        );
    }

    #[test]
    fn ids_filter_exactly_as_given_and_keep_their_spaces_on_the_next_page() {
        let filters = Filters {
            recipient: " alice".to_owned(),
            channel: "sms ".to_owned(),
            since: " 7d ".to_owned(),
            ..Filters::default()
        };
        let query = filters.query().expect("valid");
        assert_eq!(query.recipient.as_deref(), Some(" alice"));
        assert_eq!(query.channel.as_deref(), Some("sms "));
        assert_eq!(
            query.since.as_deref(),
            Some("7d"),
            "an age is read without spaces"
        );
        assert_eq!(
            filters.with_after(Some(7)),
            "recipient=%20alice&channel=sms%20&since=%207d%20&after=7"
        );
    }

    #[test]
    fn blank_fields_filter_nothing_and_bad_ones_are_refused() {
        let query = Filters::default().query().expect("blank is fine");
        assert_eq!(query.recipient, None);
        assert_eq!(query.shadow, None);
        assert_eq!(query.limit, Some(PAGE));
        let bad = Filters {
            shadow: "maybe".to_owned(),
            ..Filters::default()
        };
        assert!(matches!(bad.query(), Err(ConsoleError::Input(_))));
        let bad = Filters {
            after: "x".to_owned(),
            ..Filters::default()
        };
        assert!(matches!(bad.query(), Err(ConsoleError::Input(_))));
    }
}
