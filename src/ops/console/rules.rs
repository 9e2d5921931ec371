//! The running policy, and per rule what it did over the last 7 days: its verdicts (allowed,
//! refused), the decisions it took part in by outcome and its shadow refusals, from the
//! decision rollup and the rule verdict counts.

use std::collections::BTreeMap;

use askama::Template;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use chrono::TimeDelta;

use super::ConsoleState;
use super::{render, ConsoleError, Layout, Session};
use crate::decide::outcome::OutcomeName;

/// The rule's own verdicts, the table's first columns: of the decisions that checked it, how
/// many it allowed and refused (a shadow rule's refusals among them).
const VERDICT_COLUMNS: [&str; 2] = ["allowed", "refused"];

/// The outcomes a rule can make, as the table's next columns ([`OutcomeName::RULES_MAKE`]).
const COLUMNS: &[OutcomeName] = OutcomeName::RULES_MAKE;

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
    State(state): State<ConsoleState>,
    Extension(session): Extension<Session>,
) -> Response {
    let since = state.clock.now() - TimeDelta::days(7);
    let counted = match crate::record::rollup::rule_counts(state.denials.pool(), since).await {
        Ok(c) => c,
        Err(e) => return ConsoleError::Service(e.to_string()).into_response(),
    };
    let verdicts = match crate::record::rollup::rule_verdicts(state.denials.pool(), since).await {
        Ok(v) => v,
        Err(e) => return ConsoleError::Service(e.to_string()).into_response(),
    };
    // Per rule: its verdicts allowed and refused, then the decisions it took part in by outcome.
    let width = VERDICT_COLUMNS.len() + COLUMNS.len();
    let mut by_rule: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (rule, allowed, refused) in verdicts {
        let counts = by_rule.entry(rule).or_insert_with(|| vec![0; width]);
        counts[0] += allowed;
        counts[1] += refused;
    }
    for c in counted {
        if let Some(col) = COLUMNS.iter().position(|o| o.as_str() == c.outcome) {
            by_rule.entry(c.rule).or_insert_with(|| vec![0; width])[VERDICT_COLUMNS.len() + col] +=
                c.verdicts;
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
            counts: by_rule.remove(&r.name).unwrap_or_else(|| vec![0; width]),
        })
        .collect();
    render(&Page {
        layout: Layout::new(&session, "Rules", "rules"),
        hash: running.hash.clone(),
        toml: crate::rules::reload::policy_toml(&running.policy),
        columns: VERDICT_COLUMNS
            .into_iter()
            .chain(COLUMNS.iter().map(|o| o.as_str()))
            .collect(),
        rules,
        gone: by_rule.into_iter().collect(),
    })
}
