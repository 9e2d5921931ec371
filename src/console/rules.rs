//! The running policy, and per rule what it did over the last 7 days: its verdict counts by
//! outcome and its shadow refusals, from the decision rollup.

use std::collections::BTreeMap;

use askama::Template;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use chrono::TimeDelta;

use super::{render, ConsoleError, Layout, Session};
use crate::admin::AdminState;
use crate::outcome::OutcomeName;

/// The outcomes a rule can make, as the table's columns.
const COLUMNS: [OutcomeName; 6] = [
    OutcomeName::Deny,
    OutcomeName::Delay,
    OutcomeName::Shadow,
    OutcomeName::Expired,
    OutcomeName::Digested,
    OutcomeName::Unchecked,
];

/// One rule's line.
struct RuleLine {
    name: String,
    kind: String,
    scope: String,
    on_deny: String,
    matches: String,
    counts: Vec<i64>,
}

/// The rules page.
#[derive(Template)]
#[template(path = "rules.html")]
struct Page {
    layout: Layout,
    hash: String,
    toml: String,
    columns: Vec<&'static str>,
    rules: Vec<RuleLine>,
    /// Counted rules the running policy no longer has (renamed or removed within the week).
    gone: Vec<(String, Vec<i64>)>,
}

/// `GET /ui/rules`.
pub async fn page(
    State(state): State<AdminState>,
    Extension(session): Extension<Session>,
) -> Response {
    let since = state.clock.now() - TimeDelta::days(7);
    let counted = match crate::rollup::rule_counts(state.denials.pool(), since).await {
        Ok(c) => c,
        Err(e) => return ConsoleError::Service(e.to_string()).into_response(),
    };
    let mut by_rule: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for c in counted {
        if let Some(col) = COLUMNS.iter().position(|o| o.as_str() == c.outcome) {
            by_rule
                .entry(c.rule)
                .or_insert_with(|| vec![0; COLUMNS.len()])[col] += c.verdicts;
        }
    }
    let running = state.reloader.rules().current();
    let list = |v: &[String]| {
        if v.is_empty() {
            "any".to_owned()
        } else {
            v.join(", ")
        }
    };
    let rules = running
        .policy
        .rules
        .iter()
        .map(|r| RuleLine {
            name: r.name.clone(),
            kind: r.kind.name().to_owned(),
            scope: serde_json::to_value(r.scope)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            on_deny: r.on_deny.as_str().to_owned(),
            matches: format!(
                "channels: {}; categories: {}",
                list(&r.matcher.channels),
                list(&r.matcher.categories)
            ),
            counts: by_rule
                .remove(&r.name)
                .unwrap_or_else(|| vec![0; COLUMNS.len()]),
        })
        .collect();
    render(&Page {
        layout: Layout::new(&session, "Rules", "rules"),
        hash: running.hash.clone(),
        toml: crate::reload::policy_toml(&running.policy),
        columns: COLUMNS.iter().map(|o| o.as_str()).collect(),
        rules,
        gone: by_rule.into_iter().collect(),
    })
}
