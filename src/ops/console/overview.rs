//! The overview: decisions by outcome and denials by rule, per hour over the last 7 days, from
//! the decision rollup ([`crate::record::rollup`]).

use std::collections::BTreeMap;

use askama::Template;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use serde::Serialize;

use super::ConsoleState;
use super::{render, ConsoleError, Layout, Session};
use crate::record::rollup::{self, HourCount, Hourly};

/// How far back the charts go.
const DAYS: i64 = 7;

/// One chart's data, as `console.js` reads it: hours (unix seconds) and a series per label,
/// a count for every hour (0 where nothing was counted, so the lines are whole).
#[derive(Debug, Serialize)]
struct ChartData {
    x: Vec<i64>,
    series: Vec<Series>,
}

#[derive(Debug, Serialize)]
struct Series {
    label: String,
    values: Vec<i64>,
}

/// A chart on the page, with its totals as a table for readers without the script.
struct Chart {
    id: &'static str,
    title: &'static str,
    /// [`ChartData`] as JSON, shown HTML-escaped in a data attribute.
    json: String,
    /// Each series' total over the whole range, largest first.
    totals: Vec<(String, i64)>,
}

impl Chart {
    fn new(
        id: &'static str,
        title: &'static str,
        hours: &[DateTime<Utc>],
        counts: &[HourCount],
    ) -> Chart {
        let index: BTreeMap<DateTime<Utc>, usize> =
            hours.iter().enumerate().map(|(i, h)| (*h, i)).collect();
        let mut by_label: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
        for c in counts {
            let Some(&i) = index.get(&c.hour) else {
                continue;
            };
            by_label
                .entry(label(&c.series))
                .or_insert_with(|| vec![0; hours.len()])[i] += c.count;
        }
        let mut totals: Vec<(String, i64)> = by_label
            .iter()
            .map(|(l, v)| ((*l).to_owned(), v.iter().sum()))
            .collect();
        totals.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let data = ChartData {
            x: hours.iter().map(|h| h.timestamp()).collect(),
            series: by_label
                .into_iter()
                .map(|(l, values)| Series {
                    label: l.to_owned(),
                    values,
                })
                .collect(),
        };
        Chart {
            id,
            title,
            json: serde_json::to_string(&data).unwrap_or_else(|_| "{}".to_owned()),
            totals,
        }
    }
}

/// A series' label: an empty rule is an outcome no rule made.
fn label(series: &str) -> &str {
    if series.is_empty() {
        "(no rule)"
    } else {
        series
    }
}

/// The overview page.
#[derive(Template)]
#[template(path = "overview.html")]
struct Overview {
    layout: Layout,
    since: String,
    until: String,
    charts: Vec<Chart>,
}

/// `GET /ui`.
pub async fn page(
    State(state): State<ConsoleState>,
    Extension(session): Extension<Session>,
) -> Response {
    let now = state.clock.now();
    // Whole hours, the current one included: 7 × 24 points.
    let last = now.duration_trunc(TimeDelta::hours(1)).unwrap_or(now);
    let first = last - TimeDelta::hours(DAYS * 24 - 1);
    let hours: Vec<DateTime<Utc>> = (0..DAYS * 24)
        .map(|i| first + TimeDelta::hours(i))
        .collect();
    let pool = state.reads.pool();
    let (outcomes, denials) = match tokio::try_join!(
        rollup::hourly(pool, first, Hourly::Outcomes),
        rollup::hourly(pool, first, Hourly::DenialsByRule)
    ) {
        Ok(both) => both,
        Err(e) => return ConsoleError::Service(state.reads.failed(e).to_string()).into_response(),
    };
    render(&Overview {
        layout: Layout::new(&session, "Overview", "overview"),
        since: super::utc(first),
        until: super::utc(now),
        charts: vec![
            Chart::new(
                "chart-outcomes",
                "Decisions by outcome, per hour",
                &hours,
                &outcomes,
            ),
            Chart::new(
                "chart-denials",
                "Denials by rule, per hour",
                &hours,
                &denials,
            ),
        ],
    })
}
