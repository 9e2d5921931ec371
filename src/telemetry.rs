//! Logs and metrics: the tracing subscriber, the Prometheus recorder, and the metric names.
//!
//! Metric names are constants here so the worker, the admin API and the tests agree on them.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

/// Counter: messages decided, by `outcome` (allow, deny, delay, shadow, duplicate, invalid).
pub const DECISIONS: &str = "sendquota_decisions_total";
/// Counter: rule verdicts, by `rule` and `verdict` (allow, deny).
pub const RULE_VERDICTS: &str = "sendquota_rule_verdicts_total";
/// Histogram: seconds spent deciding one message in Redis (every scope's script call).
pub const DECISION_SECONDS: &str = "sendquota_decision_seconds";
/// Histogram: seconds to publish a dispatch and get its confirm.
pub const DISPATCH_SECONDS: &str = "sendquota_dispatch_seconds";
/// Histogram: seconds to write a denial row.
pub const DENIAL_WRITE_SECONDS: &str = "sendquota_denial_write_seconds";
/// Counter: deliveries the broker marked as redelivered.
pub const REDELIVERIES: &str = "sendquota_redeliveries_total";
/// Counter: invalid messages routed to the invalid queue.
pub const INVALID: &str = "sendquota_invalid_messages_total";
/// Counter: messages parked in a delay queue.
pub const DELAYED: &str = "sendquota_delayed_messages_total";
/// Counter: decisions answered from the deny cache, without Redis.
pub const DENY_CACHE_HITS: &str = "sendquota_deny_cache_hits_total";
/// Gauge: the worker's clock minus Redis `TIME`, in milliseconds.
pub const CLOCK_SKEW_MS: &str = "sendquota_clock_skew_ms";

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

/// Logs to stderr, filtered by `SENDQUOTA_LOG` (default `info`).
pub fn init_logging() {
    let filter =
        EnvFilter::try_from_env("SENDQUOTA_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
