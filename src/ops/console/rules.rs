//! The running policy, and per rule what it did over the last 7 days: its verdicts (allowed,
//! refused), the decisions it took part in by outcome and its shadow refusals, from the
//! decision rollup and the rule verdict counts.

use std::collections::BTreeMap;

use askama::Template;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use chrono::{DateTime, TimeDelta, Utc};

use super::ConsoleState;
use super::{render, ConsoleError, Layout, Session};
use crate::decide::outcome::OutcomeName;
use crate::record::rollup::{self, RollupError};
use crate::rules::policy::Rule;

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
    let mut by_rule = match counts_by_rule(&state, since).await {
        Ok(counts) => counts,
        Err(e) => return e.into_response(),
    };
    let running = state.reloader.rules().current();
    let rules = running
        .policy
        .rules
        .iter()
        .map(|r| {
            let counts = by_rule.remove(&r.name).unwrap_or_else(|| vec![0; WIDTH]);
            RuleLine::of(r, counts)
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

/// The table's counts per column.
const WIDTH: usize = VERDICT_COLUMNS.len() + COLUMNS.len();

/// Per rule counted since `since`: its verdicts allowed and refused, then the decisions it
/// took part in by outcome.
async fn counts_by_rule(
    state: &ConsoleState,
    since: DateTime<Utc>,
) -> Result<BTreeMap<String, Vec<i64>>, ConsoleError> {
    let service = |e: RollupError| ConsoleError::Service(state.reads.failed(e).to_string());
    let counted = rollup::rule_counts(state.reads.pool(), since)
        .await
        .map_err(service)?;
    let verdicts = rollup::rule_verdicts(state.reads.pool(), since)
        .await
        .map_err(service)?;
    let mut by_rule: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (rule, allowed, refused) in verdicts {
        let counts = by_rule.entry(rule).or_insert_with(|| vec![0; WIDTH]);
        counts[0] += allowed;
        counts[1] += refused;
    }
    for c in counted {
        if let Some(col) = COLUMNS.iter().position(|o| o.as_str() == c.outcome) {
            by_rule.entry(c.rule).or_insert_with(|| vec![0; WIDTH])[VERDICT_COLUMNS.len() + col] +=
                c.verdicts;
        }
    }
    Ok(by_rule)
}

impl RuleLine {
    /// `rule`'s line, with its `counts`.
    fn of(rule: &Rule, counts: Vec<i64>) -> RuleLine {
        let list = |v: &[String]| {
            if v.is_empty() {
                "any".to_owned()
            } else {
                v.join(", ")
            }
        };
        RuleLine {
            name: rule.name.clone(),
            kind: rule.kind.name().to_owned(),
            scope: serde_json::to_value(rule.scope)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            on_deny: rule.on_deny.as_str().to_owned(),
            matches: format!(
                "channels: {}; categories: {}",
                list(&rule.matcher.channels),
                list(&rule.matcher.categories)
            ),
            counts,
        }
    }
}
