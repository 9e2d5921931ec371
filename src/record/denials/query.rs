//! Filters over the denial history, turned into one parameterised query.

use chrono::{DateTime, Utc};
use sqlx::{Postgres, QueryBuilder};

/// Largest page a query returns, whatever the caller asks for.
pub const MAX_LIMIT: i64 = 10_000;

/// What an operator asks of the history. Every field narrows the result; `after` continues a
/// previous page (keyset pagination on the row id, newest first).
#[derive(Debug, Clone, Default)]
pub struct DenialFilter {
    /// Only this recipient.
    pub recipient: Option<String>,
    /// Only this rule.
    pub rule: Option<String>,
    /// Only this channel.
    pub channel: Option<String>,
    /// Only this category.
    pub category: Option<String>,
    /// Denied at or after.
    pub since: Option<DateTime<Utc>>,
    /// Denied before.
    pub until: Option<DateTime<Utc>>,
    /// Only shadow (true) or only real (false) denials.
    pub shadow: Option<bool>,
    /// Only unchecked dispatches (true) or only the other rows (false).
    pub unchecked: Option<bool>,
    /// Only replayed (true) or only unreplayed (false) denials.
    pub replayed: Option<bool>,
    /// Only denials whose retry_after has passed at this instant (replay `--due`).
    pub due_at: Option<DateTime<Utc>>,
    /// Only denials whose message's deadline (`expires_at`) has not passed at this instant, or
    /// that have none: what a replay may still send.
    pub live_at: Option<DateTime<Utc>>,
    /// Rows with an id below this one (the last id of the previous page).
    pub after: Option<i64>,
    /// Page size.
    pub limit: i64,
}

impl DenialFilter {
    /// The query, every value a bound parameter.
    pub(super) fn build(&self) -> QueryBuilder<Postgres> {
        let mut q = QueryBuilder::new(format!(
            "SELECT {} FROM denials WHERE TRUE",
            super::sql::read()
        ));
        self.push_conditions(&mut q);
        if let Some(after) = self.after {
            q.push(" AND id < ").push_bind(after);
        }
        q.push(" ORDER BY id DESC LIMIT ")
            .push_bind(self.limit.clamp(1, MAX_LIMIT));
        q
    }

    /// Appends `AND ...` for every filter that is set.
    pub(super) fn push_conditions(&self, q: &mut QueryBuilder<Postgres>) {
        let text_filters = [
            ("recipient", &self.recipient),
            ("rule", &self.rule),
            ("channel", &self.channel),
            ("category", &self.category),
        ];
        for (column, value) in text_filters {
            if let Some(v) = value {
                q.push(format_args!(" AND {column} = "))
                    .push_bind(v.clone());
            }
        }
        if let Some(since) = self.since {
            q.push(" AND denied_at >= ").push_bind(since);
        }
        if let Some(until) = self.until {
            q.push(" AND denied_at < ").push_bind(until);
        }
        if let Some(shadow) = self.shadow {
            q.push(" AND shadow = ").push_bind(shadow);
        }
        if let Some(unchecked) = self.unchecked {
            q.push(" AND unchecked = ").push_bind(unchecked);
        }
        match self.replayed {
            Some(true) => q.push(" AND replayed_at IS NOT NULL"),
            Some(false) => q.push(" AND replayed_at IS NULL"),
            None => &mut *q,
        };
        if let Some(due) = self.due_at {
            q.push(" AND retry_after <= ").push_bind(due);
        }
        if let Some(live) = self.live_at {
            q.push(" AND (expires_at IS NULL OR expires_at > ")
                .push_bind(live)
                .push(")");
        }
    }
}
