//! The per-minute decision rollup in Postgres (table `decision_rollup`): how many decisions of
//! each outcome each rule made, minute by minute, for the console's charts and rule counts.
//!
//! The hot path only bumps a counter in memory ([`DecisionCounts::count`], one lock and one
//! hash lookup per settled delivery); a writer task ([`RollupWriter`]) takes the counters every
//! [`FLUSH_INTERVAL`] and adds them to Postgres with one upsert, so a busy worker writes a
//! handful of rows a second, never one per message. Several workers add to the same rows.
//!
//! A row counts two things: `decisions`, the decisions of that outcome recorded under that rule
//! (the denying rule, the first shadow rule that would have refused, ...; `rule` is empty for
//! an outcome no rule made, such as an allow), so summing it over rules counts each decision
//! once; and `verdicts`, how many of the outcome's decisions the rule took part in, which
//! differs only for a dispatch that several shadow rules would have refused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use sqlx::PgPool;
use tokio::sync::watch;
use tracing::warn;

use crate::base::clock::Clock;
use crate::decide::outcome::Verdict;
use crate::decide::outcome::{Handled, OutcomeName};

/// How often the counters are written: a second keeps the charts current while a busy worker
/// still writes one statement a second.
pub const FLUSH_INTERVAL: Duration = Duration::from_secs(1);

/// How long rows are kept: the console shows 7 days; a month leaves room to look back at an
/// incident after the fact, at a few thousand small rows a day.
const RETENTION: TimeDelta = TimeDelta::days(30);

/// How often old rows are deleted: retention is counted in days, an hour is plenty.
const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// What one (minute, outcome, rule) counted since the last flush.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counts {
    decisions: i64,
    verdicts: i64,
}

/// Rules by name, within one (minute, outcome): keyed by `String` but looked up by `&str`, so
/// counting a decision allocates only the first time a minute sees its rule.
type ByRule = HashMap<String, Counts>;

/// Rules by name, within one minute: how many verdicts each gave, allowed and refused.
type VerdictsByRule = HashMap<String, (i64, i64)>;

/// Counters of settled decisions not written yet; shared by every delivery's task.
#[derive(Debug, Default)]
pub struct DecisionCounts {
    /// (minute since the epoch, outcome index) -> rule -> counts. A std Mutex: it is held for
    /// a hash lookup, never across an await.
    pending: Mutex<HashMap<(i64, usize), ByRule>>,
    /// Minute since the epoch -> rule -> (allowed, refused): table `rule_verdicts`.
    verdicts: Mutex<HashMap<i64, VerdictsByRule>>,
}

impl DecisionCounts {
    /// Counts one settled delivery, decided at `at`.
    pub fn count(&self, at: DateTime<Utc>, handled: &Handled) {
        let key = (at.timestamp().div_euclid(60), handled.name().index());
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let by_rule = pending.entry(key).or_default();
        match handled.rules().split_first() {
            None => bump(by_rule, "", 1, 0),
            Some((first, rest)) => {
                bump(by_rule, first, 1, 1);
                for rule in rest {
                    bump(by_rule, rule, 0, 1);
                }
            }
        }
    }

    /// Counts the verdicts of one decision made at `at`, one per rule that checked the
    /// message: each rule's allowed and refused counts on the rules page (a shadow rule's
    /// refusals among them). Counted per decision made, as `sendquota_rule_verdicts_total` is.
    pub fn verdicts(&self, at: DateTime<Utc>, verdicts: &[Verdict]) {
        let minute = at.timestamp().div_euclid(60);
        let mut pending = self.verdicts.lock().unwrap_or_else(|p| p.into_inner());
        let by_rule = pending.entry(minute).or_default();
        for v in verdicts {
            let (allowed, refused) = (i64::from(v.allowed), i64::from(!v.allowed));
            match by_rule.get_mut(v.rule.as_str()) {
                Some(c) => {
                    c.0 += allowed;
                    c.1 += refused;
                }
                None => {
                    by_rule.insert(v.rule.clone(), (allowed, refused));
                }
            }
        }
    }

    /// Takes every verdict counter, leaving none.
    fn take_verdicts(&self) -> HashMap<i64, VerdictsByRule> {
        std::mem::take(&mut *self.verdicts.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Puts verdict counters back (a write failed), added to those counted meanwhile.
    fn restore_verdicts(&self, taken: HashMap<i64, VerdictsByRule>) {
        let mut pending = self.verdicts.lock().unwrap_or_else(|p| p.into_inner());
        for (minute, rules) in taken {
            let by_rule = pending.entry(minute).or_default();
            for (rule, (allowed, refused)) in rules {
                let c = by_rule.entry(rule).or_default();
                c.0 += allowed;
                c.1 += refused;
            }
        }
    }

    /// Takes every counter, leaving none.
    fn take(&self) -> HashMap<(i64, usize), ByRule> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Puts counters back (a write failed): they are added to what was counted meanwhile.
    fn restore(&self, taken: HashMap<(i64, usize), ByRule>) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        for (key, rules) in taken {
            let by_rule = pending.entry(key).or_default();
            for (rule, c) in rules {
                bump(by_rule, &rule, c.decisions, c.verdicts);
            }
        }
    }
}

fn bump(by_rule: &mut ByRule, rule: &str, decisions: i64, verdicts: i64) {
    match by_rule.get_mut(rule) {
        Some(c) => {
            c.decisions += decisions;
            c.verdicts += verdicts;
        }
        None => {
            by_rule.insert(
                rule.to_owned(),
                Counts {
                    decisions,
                    verdicts,
                },
            );
        }
    }
}

/// The first instant of `minute` (minutes since the epoch), as the rows are keyed.
fn minute_start(minute: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(minute * 60, 0).unwrap_or_default()
}

/// Failures reading or writing the rollup.
#[derive(Debug, thiserror::Error)]
pub enum RollupError {
    /// Postgres failed the statement.
    #[error("postgres (decision rollup): {0}")]
    Database(#[from] sqlx::Error),
}

/// The task that writes [`DecisionCounts`] to Postgres.
pub struct RollupWriter {
    counts: Arc<DecisionCounts>,
    pool: PgPool,
    clock: Arc<dyn Clock>,
}

impl RollupWriter {
    /// A writer of `counts` into `pool`, pruning by `clock` (the worker's, which also dates the
    /// rows).
    pub fn new(counts: Arc<DecisionCounts>, pool: PgPool, clock: Arc<dyn Clock>) -> RollupWriter {
        RollupWriter {
            counts,
            pool,
            clock,
        }
    }

    /// Writes every [`FLUSH_INTERVAL`] until `stop`, then once more; the returned handle ends
    /// after that last write, so the worker can wait for it before it exits.
    pub fn spawn(self, mut stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut last_prune: Option<tokio::time::Instant> = None;
            loop {
                let stopping = tokio::select! {
                    _ = tokio::time::sleep(FLUSH_INTERVAL) => false,
                    _ = stop.wait_for(|s| *s) => true,
                };
                if let Err(e) = self.flush().await {
                    warn!(error = %e, "decision rollup not written; kept for the next flush");
                }
                if stopping {
                    return;
                }
                if last_prune.is_none_or(|at| at.elapsed() >= PRUNE_EVERY) {
                    last_prune = Some(tokio::time::Instant::now());
                    if let Err(e) = self.prune().await {
                        warn!(error = %e, "old decision rollup rows not deleted");
                    }
                }
            }
        })
    }

    /// Adds what was counted since the last flush to Postgres in one statement; on failure the
    /// counters are kept for the next one.
    pub async fn flush(&self) -> Result<(), RollupError> {
        let decisions = self.flush_decisions().await;
        let verdicts = self.flush_verdicts().await;
        decisions.and(verdicts)
    }

    /// Adds the verdict counters to `rule_verdicts` in one statement; kept on failure.
    async fn flush_verdicts(&self) -> Result<(), RollupError> {
        let taken = self.counts.take_verdicts();
        if taken.is_empty() {
            return Ok(());
        }
        // Sorted, as the decisions are: no deadlock between workers.
        let mut rows: Vec<(i64, &str, (i64, i64))> = taken
            .iter()
            .flat_map(|(&minute, rules)| rules.iter().map(move |(r, c)| (minute, r.as_str(), *c)))
            .collect();
        rows.sort_unstable_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        let minutes: Vec<DateTime<Utc>> = rows.iter().map(|r| minute_start(r.0)).collect();
        let rules: Vec<&str> = rows.iter().map(|r| r.1).collect();
        let allowed: Vec<i64> = rows.iter().map(|r| r.2 .0).collect();
        let refused: Vec<i64> = rows.iter().map(|r| r.2 .1).collect();
        let written = sqlx::query(
            "INSERT INTO rule_verdicts (minute, rule, allowed, refused) \
             SELECT * FROM unnest($1::timestamptz[], $2::text[], $3::bigint[], $4::bigint[]) \
             ON CONFLICT (minute, rule) DO UPDATE SET \
             allowed = rule_verdicts.allowed + excluded.allowed, \
             refused = rule_verdicts.refused + excluded.refused",
        )
        .bind(minutes)
        .bind(rules)
        .bind(allowed)
        .bind(refused)
        .execute(&self.pool)
        .await;
        if let Err(e) = written {
            self.counts.restore_verdicts(taken);
            return Err(e.into());
        }
        Ok(())
    }

    /// Adds the decision counters to `decision_rollup` in one statement; kept on failure.
    async fn flush_decisions(&self) -> Result<(), RollupError> {
        let taken = self.counts.take();
        if taken.is_empty() {
            return Ok(());
        }
        // Sorted: two workers upserting the same rows in the same order cannot deadlock.
        let mut rows: Vec<(i64, usize, &str, Counts)> = taken
            .iter()
            .flat_map(|(&(minute, outcome), rules)| {
                rules
                    .iter()
                    .map(move |(rule, c)| (minute, outcome, rule.as_str(), *c))
            })
            .collect();
        rows.sort_unstable_by(|a, b| (a.0, a.1, a.2).cmp(&(b.0, b.1, b.2)));
        let minutes: Vec<DateTime<Utc>> = rows.iter().map(|r| minute_start(r.0)).collect();
        let outcomes: Vec<&str> = rows
            .iter()
            .map(|r| OutcomeName::ALL[r.1].as_str())
            .collect();
        let rules: Vec<&str> = rows.iter().map(|r| r.2).collect();
        let decisions: Vec<i64> = rows.iter().map(|r| r.3.decisions).collect();
        let verdicts: Vec<i64> = rows.iter().map(|r| r.3.verdicts).collect();
        let written = sqlx::query(
            "INSERT INTO decision_rollup (minute, outcome, rule, decisions, verdicts) \
             SELECT * FROM unnest($1::timestamptz[], $2::text[], $3::text[], $4::bigint[], \
             $5::bigint[]) \
             ON CONFLICT (minute, outcome, rule) DO UPDATE SET \
             decisions = decision_rollup.decisions + excluded.decisions, \
             verdicts = decision_rollup.verdicts + excluded.verdicts",
        )
        .bind(minutes)
        .bind(outcomes)
        .bind(rules)
        .bind(decisions)
        .bind(verdicts)
        .execute(&self.pool)
        .await;
        if let Err(e) = written {
            self.counts.restore(taken);
            return Err(e.into());
        }
        Ok(())
    }

    /// Deletes rows older than [`RETENTION`].
    async fn prune(&self) -> Result<(), RollupError> {
        for table in ["decision_rollup", "rule_verdicts"] {
            let sql = format!("DELETE FROM {table} WHERE minute < $1");
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(self.clock.now() - RETENTION)
                .execute(&self.pool)
                .await?;
        }
        Ok(())
    }
}

/// One hour's count of one series (an outcome, or a rule's denials).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct HourCount {
    /// The hour's start.
    pub hour: DateTime<Utc>,
    /// The outcome or the rule.
    pub series: String,
    /// Decisions in that hour.
    pub count: i64,
}

/// What an hourly series counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hourly {
    /// Decisions by outcome: the overview's first chart.
    Outcomes,
    /// Denials by rule: the overview's second chart.
    DenialsByRule,
}

/// The hourly counts `what` asks for since `since`, oldest first.
pub async fn hourly(
    pool: &PgPool,
    since: DateTime<Utc>,
    what: Hourly,
) -> Result<Vec<HourCount>, RollupError> {
    let (series, only) = match what {
        Hourly::Outcomes => ("outcome", ""),
        Hourly::DenialsByRule => ("rule", " AND outcome = 'deny'"),
    };
    let sql = format!(
        "SELECT date_trunc('hour', minute, 'UTC') AS hour, {series} AS series, \
         sum(decisions)::bigint AS count FROM decision_rollup WHERE minute >= $1{only} \
         GROUP BY 1, 2 ORDER BY 1, 2"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(since)
        .fetch_all(pool)
        .await?)
}

/// How often one rule made one outcome.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct RuleCount {
    /// The rule.
    pub rule: String,
    /// The outcome (`deny`, `delay`, `shadow`, ...).
    pub outcome: String,
    /// Decisions of that outcome the rule took part in.
    pub verdicts: i64,
}

/// Every rule's verdict counts by outcome since `since`: the rules page.
pub async fn rule_counts(
    pool: &PgPool,
    since: DateTime<Utc>,
) -> Result<Vec<RuleCount>, RollupError> {
    Ok(sqlx::query_as(
        "SELECT rule, outcome, sum(verdicts)::bigint AS verdicts FROM decision_rollup \
         WHERE minute >= $1 AND rule <> '' GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .bind(since)
    .fetch_all(pool)
    .await?)
}

/// Every rule's verdicts since `since`: (rule, allowed, refused), by rule name.
pub async fn rule_verdicts(
    pool: &PgPool,
    since: DateTime<Utc>,
) -> Result<Vec<(String, i64, i64)>, RollupError> {
    Ok(sqlx::query_as(
        "SELECT rule, sum(allowed)::bigint, sum(refused)::bigint FROM rule_verdicts \
         WHERE minute >= $1 GROUP BY 1 ORDER BY 1",
    )
    .bind(since)
    .fetch_all(pool)
    .await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(minute: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(minute * 60 + 7, 0).expect("in range")
    }

    #[test]
    fn a_decision_counts_once_under_its_first_rule_and_each_rule_gets_a_verdict() {
        let counts = DecisionCounts::default();
        counts.count(at(5), &Handled::Dispatched { shadow: vec![] });
        counts.count(
            at(5),
            &Handled::Dispatched {
                shadow: vec!["a".into(), "b".into()],
            },
        );
        counts.count(at(5), &Handled::Denied { rule: "a".into() });
        counts.count(at(6), &Handled::Denied { rule: "a".into() });
        counts.count(at(6), &Handled::Denied { rule: "a".into() });
        let taken = counts.take();
        let get = |minute, outcome: OutcomeName, rule: &str| {
            taken[&(minute, outcome.index())].get(rule).copied()
        };
        let c = |decisions, verdicts| {
            Some(Counts {
                decisions,
                verdicts,
            })
        };
        assert_eq!(get(5, OutcomeName::Allow, ""), c(1, 0));
        assert_eq!(get(5, OutcomeName::Shadow, "a"), c(1, 1));
        assert_eq!(get(5, OutcomeName::Shadow, "b"), c(0, 1));
        assert_eq!(get(5, OutcomeName::Deny, "a"), c(1, 1));
        assert_eq!(get(6, OutcomeName::Deny, "a"), c(2, 2));
        assert!(counts.take().is_empty(), "taking empties the counters");
    }

    #[test]
    fn restored_counters_add_to_those_counted_meanwhile() {
        let counts = DecisionCounts::default();
        counts.count(at(1), &Handled::Denied { rule: "a".into() });
        let taken = counts.take();
        counts.count(at(1), &Handled::Denied { rule: "a".into() });
        counts.restore(taken);
        let again = counts.take();
        assert_eq!(
            again[&(1, OutcomeName::Deny.index())]["a"],
            Counts {
                decisions: 2,
                verdicts: 2
            }
        );
    }
}
