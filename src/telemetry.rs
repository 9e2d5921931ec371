//! Logs and metrics: the tracing subscriber, the Prometheus recorder, and the metric names.
//!
//! Metric names are constants here so the worker, the admin API and the tests agree on them.

use std::collections::HashMap;
use std::sync::OnceLock;

use metrics::{Counter, Histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

use crate::outcome::OutcomeName;

/// Counter: messages handled, by `outcome` (the labels of `OutcomeName`), counted once each
/// outcome is durable: a retried attempt is not counted again.
pub const DECISIONS: &str = "sendquota_decisions_total";
/// Counter: rule verdicts, by `rule` and `verdict` (allow, deny).
pub const RULE_VERDICTS: &str = "sendquota_rule_verdicts_total";
/// Histogram: seconds spent deciding one message in Redis (every scope's script call).
pub const DECISION_SECONDS: &str = "sendquota_decision_seconds";
/// Histogram: seconds to publish a dispatch and get its confirm.
pub const DISPATCH_SECONDS: &str = "sendquota_dispatch_seconds";
/// Histogram: seconds to write a denial row.
pub const DENIAL_WRITE_SECONDS: &str = "sendquota_denial_write_seconds";
/// Counter: denial batches committed (one statement each); the denials written divided by it is
/// the mean batch size, which says whether `denial_batch_size` or `denial_batch_wait_ms` binds.
pub const DENIAL_BATCHES: &str = "sendquota_denial_batches_total";
/// Counter: deliveries the broker marked as redelivered.
pub const REDELIVERIES: &str = "sendquota_redeliveries_total";
/// Counter: invalid messages routed to the invalid queue.
pub const INVALID: &str = "sendquota_invalid_messages_total";
/// Counter: messages moved to the quarantine queue (a service refused them for good).
pub const QUARANTINED: &str = "sendquota_quarantined_messages_total";
/// Counter: messages that kept failing in their slot and moved to a delay queue to be retried
/// from there, freeing the slot.
pub const SLOTS_YIELDED: &str = "sendquota_slots_yielded_total";
/// Counter: messages parked in a delay queue.
pub const DELAYED: &str = "sendquota_delayed_messages_total";
/// Counter: decisions answered from the deny cache, without Redis.
pub const DENY_CACHE_HITS: &str = "sendquota_deny_cache_hits_total";
/// Counter: ack frames sent to the broker, by `kind`: `multiple` (one frame settling a run of
/// deliveries) or `single` (a delivery held too long behind an unfinished one). Fewer frames
/// per message is less work for the worker and, on a quorum queue, for the broker's log.
pub const ACK_FRAMES: &str = "sendquota_ack_frames_total";
/// Gauge: the worker's clock minus Redis `TIME`, in milliseconds.
pub const CLOCK_SKEW_MS: &str = "sendquota_clock_skew_ms";
/// Gauge: worker threads of the runtime the worker runs on (`worker.threads`; its blocking
/// pool, where client crates resolve host names, is not counted).
pub const RUNTIME_WORKER_THREADS: &str = "sendquota_runtime_worker_threads";

/// Histogram buckets for latencies, in seconds (0.25 ms to 5 s).
const LATENCY_BUCKETS: &[f64] = &[
    0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// The process-wide Prometheus recorder, installed on first use. If another recorder is
/// already installed (an embedding application), a private one is returned whose output is
/// empty rather than failing.
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = || {
            PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .expect("latency buckets are not empty")
        };
        builder()
            .install_recorder()
            .unwrap_or_else(|_| builder().build_recorder().handle())
    })
}

/// The metrics recorded for every message, registered once. `metrics::counter!` with labels
/// builds, hashes and looks up its key on every call, work repeated for every message that
/// registered handles do once: a message's metrics are then increments of handles held here.
pub struct MessageMetrics {
    outcomes: [Counter; OutcomeName::ALL.len()],
    verdicts: HashMap<String, [Counter; 2]>,
    /// [`DECISION_SECONDS`].
    pub decision_seconds: Histogram,
    /// [`DISPATCH_SECONDS`].
    pub dispatch_seconds: Histogram,
    /// [`DENIAL_WRITE_SECONDS`].
    pub denial_write_seconds: Histogram,
}

impl MessageMetrics {
    /// Registers every message metric, with a verdict counter pair for each of `rules`.
    pub fn register<'a>(rules: impl IntoIterator<Item = &'a str>) -> MessageMetrics {
        let verdict = |rule: &str, verdict: &'static str| metrics::counter!(RULE_VERDICTS, "rule" => rule.to_owned(), "verdict" => verdict);
        MessageMetrics {
            outcomes: OutcomeName::ALL
                .map(|outcome| metrics::counter!(DECISIONS, "outcome" => outcome.as_str())),
            verdicts: rules
                .into_iter()
                .map(|rule| {
                    (
                        rule.to_owned(),
                        [verdict(rule, "allow"), verdict(rule, "deny")],
                    )
                })
                .collect(),
            decision_seconds: metrics::histogram!(DECISION_SECONDS),
            dispatch_seconds: metrics::histogram!(DISPATCH_SECONDS),
            denial_write_seconds: metrics::histogram!(DENIAL_WRITE_SECONDS),
        }
    }

    /// Counts one message decided with `outcome`.
    pub fn outcome(&self, outcome: OutcomeName) {
        self.outcomes[outcome.index()].increment(1);
    }

    /// Counts one verdict of `rule`.
    pub fn verdict(&self, rule: &str, allowed: bool) {
        match self.verdicts.get(rule) {
            Some(pair) => pair[usize::from(!allowed)].increment(1),
            None => {
                let verdict = if allowed { "allow" } else { "deny" };
                metrics::counter!(RULE_VERDICTS, "rule" => rule.to_owned(), "verdict" => verdict)
                    .increment(1)
            }
        }
    }
}

/// The log filter when `SENDQUOTA_LOG` is unset. lapin logs every connection error at ERROR
/// from its I/O thread and also returns it to the caller, which the worker reports once (a
/// start-up failure's one line, or "broker session lost"): its own lines would only repeat it.
pub const DEFAULT_LOG_FILTER: &str = "info,lapin=off";

/// Logs to stderr, filtered by `SENDQUOTA_LOG` (default [`DEFAULT_LOG_FILTER`]).
pub fn init_logging() {
    let filter = EnvFilter::try_from_env("SENDQUOTA_LOG")
        .unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG_FILTER));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(rendered: &str, series: &str) -> Option<f64> {
        rendered
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
    }

    #[test]
    fn registered_message_metrics_land_in_the_prometheus_output() {
        let handle = prometheus();
        let m = MessageMetrics::register(["metrics-test-rule"]);
        m.outcome(OutcomeName::Duplicate);
        m.outcome(OutcomeName::Duplicate);
        m.verdict("metrics-test-rule", false);
        m.verdict("metrics-test-unregistered", true);
        let out = handle.render();
        assert_eq!(
            sample(
                &out,
                r#"sendquota_rule_verdicts_total{rule="metrics-test-rule",verdict="deny"}"#
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &out,
                r#"sendquota_rule_verdicts_total{rule="metrics-test-rule",verdict="allow"}"#
            ),
            Some(0.0),
            "registered series are exported from the start"
        );
        assert_eq!(
            sample(
                &out,
                r#"sendquota_rule_verdicts_total{rule="metrics-test-unregistered",verdict="allow"}"#
            ),
            Some(1.0)
        );
        assert!(sample(&out, r#"sendquota_decisions_total{outcome="duplicate"}"#) >= Some(2.0));
    }
}
