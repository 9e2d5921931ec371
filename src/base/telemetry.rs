//! Logs and metrics: the tracing subscriber, the Prometheus recorder, and the metric names.
//!
//! Metric names are constants here, and [`FAMILIES`] describes each, so the worker, the admin
//! API, the deploy files (dashboard, alert rules) and the tests agree on them. Names follow
//! Prometheus conventions: base units (`_seconds`), `_total` on counters only.

use std::fmt;
use std::sync::OnceLock;

use hmac::{KeyInit, Mac};
use metrics::{Counter, Gauge, Histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

use crate::base::config::{LogFormat, LogSettings, RecipientLog};
use crate::decide::outcome::OutcomeName;
use crate::request::message::SendRequest;
use crate::rules::policy::Policy;

/// Counter: messages handled, by `outcome` (the labels of `OutcomeName`), `channel` and
/// `category` (see [`OTHER`]), counted once each outcome is durable: a retried attempt is not
/// counted again.
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
/// Counter: denial writes that failed (a batch Postgres did not commit, or one row it
/// refused); every message in it is retried.
pub const DENIAL_WRITE_FAILURES: &str = "sendquota_denial_write_failures_total";
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
/// Counter: messages dispatched unchecked: Redis was unavailable and every rule matching them
/// has `on_unavailable = "allow"` (each also counted under outcome `unchecked`). Apart from
/// the outcome so an alert can watch fail-open dispatches whatever the channel.
pub const UNCHECKED: &str = "sendquota_unchecked_dispatches_total";
/// Counter: decisions answered from the deny cache, without Redis.
pub const DENY_CACHE_HITS: &str = "sendquota_deny_cache_hits_total";
/// Counter: committing Redis calls that fewer replicas than `redis.wait_replicas` acknowledged
/// within `redis.wait_timeout_ms`. Each stands on the master, and a failover before a replica
/// copies it would lose it: the alert that replication lags or a replica is gone.
pub const REDIS_UNREPLICATED: &str = "sendquota_redis_unreplicated_total";
/// Counter: ack frames sent to the broker, by `kind`: `multiple` (one frame settling a run of
/// deliveries) or `single` (a delivery held too long behind an unfinished one). Fewer frames
/// per message is less work for the worker and, on a quorum queue, for the broker's log.
pub const ACK_FRAMES: &str = "sendquota_ack_frames_total";
/// Counter: rule reloads (SIGHUP or the admin API) that did not apply: the file did not load
/// or validate, or the change could not be audited. The running rules stayed.
pub const POLICY_RELOAD_FAILURES: &str = "sendquota_policy_reload_failures_total";
/// Gauge: deliveries taken from the requests queue whose outcome is not settled yet.
pub const DELIVERIES_IN_FLIGHT: &str = "sendquota_deliveries_in_flight";
/// Gauge: 1 when the worker is ready as `/readyz` says, else 0; measured at each scrape.
pub const READY: &str = "sendquota_ready";
/// Gauge: the worker's clock minus Redis `TIME`, in seconds.
pub const CLOCK_SKEW_SECONDS: &str = "sendquota_clock_skew_seconds";
/// Gauge: worker threads of the runtime the worker runs on (`worker.threads`; its blocking
/// pool, where client crates resolve host names, is not counted).
pub const RUNTIME_WORKER_THREADS: &str = "sendquota_runtime_worker_threads";

/// The `channel` or `category` label of [`DECISIONS`] for a value no rule names in its match
/// lists: the labels' values come from the configuration, never from what producers send, so
/// the number of series is bounded by the configuration.
pub const OTHER: &str = "other";

/// The kinds of Prometheus metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up; rated.
    Counter,
    /// A value now.
    Gauge,
    /// Samples in [`LATENCY_BUCKETS`].
    Histogram,
}

/// One metric family the worker exports: its name, kind and the help line `/metrics` shows.
#[derive(Debug)]
pub struct Family {
    /// The family's name (without a histogram's `_bucket`, `_sum`, `_count`).
    pub name: &'static str,
    /// Its kind.
    pub kind: MetricKind,
    /// The `# HELP` text.
    pub help: &'static str,
}

/// Every metric family the worker exports. Each is described at start and, apart from the
/// per-rule and per-outcome series registered with [`MessageMetrics`], exported from then on,
/// zero until it counts: a family with no series would show nothing in `/metrics`, and an alert
/// or panel over it could not tell "none yet" from "not exported".
pub const FAMILIES: &[Family] = &[
    Family::counter(DECISIONS, "Messages handled, by outcome, channel and category (values no rule names are \"other\"), counted once the outcome is durable."),
    Family::counter(RULE_VERDICTS, "Rule verdicts, by rule and verdict (allow, deny)."),
    Family::histogram(DECISION_SECONDS, "Seconds spent deciding one message in Redis."),
    Family::histogram(DISPATCH_SECONDS, "Seconds to publish a dispatch and get its confirm."),
    Family::histogram(DENIAL_WRITE_SECONDS, "Seconds to write a denial row (its batch committed)."),
    Family::counter(DENIAL_BATCHES, "Denial batches committed."),
    Family::counter(DENIAL_WRITE_FAILURES, "Denial writes that failed (a batch not committed, or a row refused); their messages are retried."),
    Family::counter(REDELIVERIES, "Deliveries the broker marked as redelivered."),
    Family::counter(INVALID, "Invalid messages routed to the invalid queue."),
    Family::counter(QUARANTINED, "Messages moved to the quarantine queue."),
    Family::counter(SLOTS_YIELDED, "Messages that kept failing and moved to a delay queue, freeing their slot."),
    Family::counter(DELAYED, "Messages parked in a delay queue."),
    Family::counter(UNCHECKED, "Messages dispatched unchecked while Redis was unavailable (rules with on_unavailable = allow)."),
    Family::counter(DENY_CACHE_HITS, "Decisions answered from the deny cache, without Redis."),
    Family::counter(REDIS_UNREPLICATED, "Committing Redis calls fewer replicas than redis.wait_replicas acknowledged in time (with redis.wait_replicas set)."),
    Family::counter(ACK_FRAMES, "Ack frames sent to the broker, by kind (multiple, single)."),
    Family::counter(POLICY_RELOAD_FAILURES, "Rule reloads that did not apply (bad file, or no audit row); the running rules stayed."),
    Family::gauge(DELIVERIES_IN_FLIGHT, "Deliveries taken from the requests queue whose outcome is not settled yet."),
    Family::gauge(READY, "1 when the worker is ready as /readyz says, else 0."),
    Family::gauge(CLOCK_SKEW_SECONDS, "The worker's clock minus Redis TIME, in seconds."),
    Family::gauge(RUNTIME_WORKER_THREADS, "Worker threads of the worker's runtime."),
];

impl Family {
    const fn counter(name: &'static str, help: &'static str) -> Family {
        Family {
            name,
            kind: MetricKind::Counter,
            help,
        }
    }

    const fn gauge(name: &'static str, help: &'static str) -> Family {
        Family {
            name,
            kind: MetricKind::Gauge,
            help,
        }
    }

    const fn histogram(name: &'static str, help: &'static str) -> Family {
        Family {
            name,
            kind: MetricKind::Histogram,
            help,
        }
    }
}

/// The `kind` labels of [`ACK_FRAMES`].
pub const ACK_FRAME_KINDS: [&str; 2] = ["multiple", "single"];

/// Histogram buckets for latencies, in seconds (0.25 ms to 5 s).
const LATENCY_BUCKETS: &[f64] = &[
    0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// The process-wide Prometheus recorder, installed on first use with every family of
/// [`FAMILIES`] described and the series that need no configuration registered. If another
/// recorder is already installed (an embedding application), a private one is returned whose
/// output is empty rather than failing.
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = || {
            PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .expect("latency buckets are not empty")
        };
        let handle = builder()
            .install_recorder()
            .unwrap_or_else(|_| builder().build_recorder().handle());
        describe();
        handle
    })
}

/// Describes every family and registers its series that need no configuration, at zero.
fn describe() {
    for family in FAMILIES {
        match family.kind {
            MetricKind::Counter => metrics::describe_counter!(family.name, family.help),
            MetricKind::Gauge => metrics::describe_gauge!(family.name, family.help),
            MetricKind::Histogram => metrics::describe_histogram!(family.name, family.help),
        }
    }
    for name in [
        DENIAL_BATCHES,
        DENIAL_WRITE_FAILURES,
        REDELIVERIES,
        INVALID,
        QUARANTINED,
        SLOTS_YIELDED,
        DELAYED,
        UNCHECKED,
        DENY_CACHE_HITS,
        REDIS_UNREPLICATED,
        POLICY_RELOAD_FAILURES,
    ] {
        metrics::counter!(name).absolute(0);
    }
    for kind in ACK_FRAME_KINDS {
        metrics::counter!(ACK_FRAMES, "kind" => kind).absolute(0);
    }
    for family in FAMILIES.iter().filter(|f| f.kind == MetricKind::Gauge) {
        metrics::gauge!(family.name).increment(0.0);
    }
}

/// The metrics recorded for every message, registered once. `metrics::counter!` with labels
/// builds, hashes and looks up its key on every call, work repeated for every message that
/// registered handles do once: a message's metrics are then increments of handles held here.
pub struct MessageMetrics {
    labels: DecisionLabels,
    /// [`DECISIONS`], one per outcome, channel label and category label, at
    /// [`DecisionLabels::index`].
    decisions: Vec<Counter>,
    verdicts: std::collections::HashMap<String, [Counter; 2]>,
    in_flight: Gauge,
    /// [`DECISION_SECONDS`].
    pub decision_seconds: Histogram,
    /// [`DISPATCH_SECONDS`].
    pub dispatch_seconds: Histogram,
    /// [`DENIAL_WRITE_SECONDS`].
    pub denial_write_seconds: Histogram,
}

/// The `channel` and `category` label values of [`DECISIONS`]: the names the rules' match
/// lists hold, sorted so a message's are found by binary search (no allocation, no hashing),
/// and [`OTHER`] for every other value.
struct DecisionLabels {
    channels: Vec<String>,
    categories: Vec<String>,
}

impl DecisionLabels {
    fn of(policy: &Policy) -> DecisionLabels {
        let named = |list: fn(&crate::rules::policy::Rule) -> &Vec<String>| {
            let mut names: Vec<String> = policy.rules.iter().flat_map(list).cloned().collect();
            names.sort();
            names.dedup();
            names
        };
        DecisionLabels {
            channels: named(|r| &r.matcher.channels),
            categories: named(|r| &r.matcher.categories),
        }
    }

    /// Every label value of `names`, [`OTHER`] last (at index `names.len()`).
    fn values(names: &[String]) -> impl Iterator<Item = &str> {
        names.iter().map(String::as_str).chain([OTHER])
    }

    /// The place of a value in `names`: its index, or `names.len()` ([`OTHER`]).
    fn position(names: &[String], value: &str) -> usize {
        names
            .binary_search_by(|n| n.as_str().cmp(value))
            .unwrap_or(names.len())
    }

    /// Where the counter of (`outcome`, channel at `channel`, category at `category`) is.
    fn index(&self, outcome: OutcomeName, channel: usize, category: usize) -> usize {
        (outcome.index() * (self.channels.len() + 1) + channel) * (self.categories.len() + 1)
            + category
    }
}

impl MessageMetrics {
    /// Registers every message metric: a decision counter for each outcome and each of the
    /// policy's channel and category labels, and a verdict counter pair for each rule.
    pub fn register(policy: &Policy) -> MessageMetrics {
        let labels = DecisionLabels::of(policy);
        let mut decisions = Vec::new();
        for outcome in OutcomeName::ALL {
            for channel in DecisionLabels::values(&labels.channels) {
                for category in DecisionLabels::values(&labels.categories) {
                    decisions.push(metrics::counter!(DECISIONS, "outcome" => outcome.as_str(),
                        "channel" => channel.to_owned(), "category" => category.to_owned()));
                }
            }
        }
        let verdict = |rule: &str, verdict: &'static str| metrics::counter!(RULE_VERDICTS, "rule" => rule.to_owned(), "verdict" => verdict);
        MessageMetrics {
            labels,
            decisions,
            verdicts: policy
                .rules
                .iter()
                .map(|rule| {
                    let name = rule.name.as_str();
                    (
                        rule.name.clone(),
                        [verdict(name, "allow"), verdict(name, "deny")],
                    )
                })
                .collect(),
            in_flight: metrics::gauge!(DELIVERIES_IN_FLIGHT),
            decision_seconds: metrics::histogram!(DECISION_SECONDS),
            dispatch_seconds: metrics::histogram!(DISPATCH_SECONDS),
            denial_write_seconds: metrics::histogram!(DENIAL_WRITE_SECONDS),
        }
    }

    /// Counts one message decided with `outcome`; `request` is `None` for a body that was not
    /// a request (its channel and category are [`OTHER`]).
    pub fn outcome(&self, outcome: OutcomeName, request: Option<&SendRequest>) {
        let labels = &self.labels;
        let (channel, category) = match request {
            Some(r) => (
                DecisionLabels::position(&labels.channels, &r.channel),
                DecisionLabels::position(&labels.categories, &r.category),
            ),
            None => (labels.channels.len(), labels.categories.len()),
        };
        self.decisions[labels.index(outcome, channel, category)].increment(1);
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

    /// Counts a delivery in flight until the returned guard is dropped (its outcome settled,
    /// or the delivery given up).
    pub fn in_flight(&self) -> InFlight {
        self.in_flight.increment(1.0);
        InFlight(self.in_flight.clone())
    }
}

/// One delivery counted in [`DELIVERIES_IN_FLIGHT`] while it lives.
pub struct InFlight(Gauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

/// The log filter when `SENDQUOTA_LOG` is unset. lapin logs every connection error at ERROR
/// from its I/O thread and also returns it to the caller, which the worker reports once (a
/// start-up failure's one line, or "broker session lost"): its own lines would only repeat it.
pub const DEFAULT_LOG_FILTER: &str = "info,lapin=off";

/// The target of the per-message decision logs, so they can be turned on alone
/// (`SENDQUOTA_LOG=info,lapin=off,sendquota::decisions=debug`). A decided message is logged at
/// debug, off by default: a line per message would add formatting and a write to every
/// message's CPU (docs/decisions.md). An invalid message is logged at warn: it is a
/// producer's bug.
pub const DECISION_LOG: &str = "sendquota::decisions";

/// The format of log lines and how decision logs show recipients, set once with the
/// subscriber.
static LOGGING: OnceLock<(LogFormat, Recipients)> = OnceLock::new();

/// How decision logs show recipients: as written, or hashed with a key ready to clone.
enum Recipients {
    Plain,
    Hashed(hmac::Hmac<sha2::Sha256>),
}

/// Logs to stderr as `log` says (text or JSON lines), filtered by `SENDQUOTA_LOG` (default
/// [`DEFAULT_LOG_FILTER`]). Only the first call in a process takes effect.
pub fn init_logging(log: &LogSettings) {
    let recipients = match log.recipient {
        RecipientLog::Plain => Recipients::Plain,
        RecipientLog::Hash => match hmac::Hmac::new_from_slice(log.recipient_key.0.as_bytes()) {
            Ok(mac) => Recipients::Hashed(mac),
            // HMAC takes keys of any length; settings refuse short ones before this.
            Err(_) => Recipients::Plain,
        },
    };
    if LOGGING.set((log.format, recipients)).is_err() {
        return;
    }
    let filter = EnvFilter::try_from_env("SENDQUOTA_LOG")
        .unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG_FILTER));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match log.format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .try_init(),
    };
}

/// Writes the line that says why a command failed to stderr, always (whatever the filter),
/// as the log lines are: the text itself, or a JSON object shaped like the subscriber's.
pub fn report_failure(line: &str) {
    match LOGGING.get() {
        Some((LogFormat::Json, _)) => {
            // The wall time, as the subscriber's own lines carry it (also under `--now`).
            let timestamp = crate::base::clock::Clock::now(&crate::base::clock::SystemClock)
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
            let object = serde_json::json!({
                "timestamp": timestamp, "level": "ERROR", "message": line, "target": "sendquota",
            });
            eprintln!("{object}");
        }
        _ => eprintln!("{line}"),
    }
}

/// A recipient as decision logs show it ([`RecipientLog`]): the hash is computed only when a
/// line is written, so a disabled decision log costs nothing.
pub fn recipient(recipient: &str) -> LoggedRecipient<'_> {
    LoggedRecipient(recipient)
}

/// A recipient to be written in a log line; see [`recipient`].
pub struct LoggedRecipient<'a>(&'a str);

impl fmt::Display for LoggedRecipient<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match LOGGING.get() {
            Some((_, recipients)) => recipients.write(self.0, f),
            None => f.write_str(self.0),
        }
    }
}

impl Recipients {
    /// Writes `recipient` as these settings show it: itself, or its HMAC in lowercase hex
    /// (what `openssl dgst -sha256 -hmac KEY` prints, so an operator can find a recipient's
    /// lines).
    fn write(&self, recipient: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recipients::Plain => f.write_str(recipient),
            Recipients::Hashed(key) => {
                let mut mac = key.clone();
                mac.update(recipient.as_bytes());
                for byte in mac.finalize().into_bytes() {
                    write!(f, "{byte:02x}")?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(rendered: &str, series: &str) -> Option<f64> {
        rendered
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
    }

    fn policy(rules: &str) -> Policy {
        crate::base::config::Settings::from_toml(rules, |_| None)
            .expect("valid rules")
            .policy
    }

    fn request(channel: &str, category: &str) -> SendRequest {
        let body = serde_json::json!({
            "id": "m1", "recipient": "alice", "channel": channel, "category": category,
        });
        SendRequest::decode(body.to_string().as_bytes(), 4096).expect("a valid request")
    }

    #[test]
    fn registered_message_metrics_land_in_the_prometheus_output() {
        let handle = prometheus();
        let m = MessageMetrics::register(&policy(
            "[[rules]]\nname = \"metrics-test-rule\"\nkind = \"fixed_window\"\nlimit = 1\n\
             window = \"1m\"\nmatch = { channels = [\"metrics-test-sms\"] }\n",
        ));
        m.outcome(
            OutcomeName::Duplicate,
            Some(&request("metrics-test-sms", "x")),
        );
        m.outcome(
            OutcomeName::Duplicate,
            Some(&request("metrics-test-sms", "x")),
        );
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
        assert_eq!(
            sample(
                &out,
                r#"sendquota_decisions_total{outcome="duplicate",channel="metrics-test-sms",category="other"}"#
            ),
            Some(2.0)
        );
        assert_eq!(
            sample(
                &out,
                r#"sendquota_decisions_total{outcome="deny",channel="metrics-test-sms",category="other"}"#
            ),
            Some(0.0),
            "every outcome of every configured label is exported from the start"
        );
    }

    #[test]
    fn channels_and_categories_no_rule_names_are_counted_as_other() {
        let handle = prometheus();
        let m = MessageMetrics::register(&policy(concat!(
            "[[rules]]\nname = \"fold-test\"\nkind = \"fixed_window\"\nlimit = 1\n",
            "window = \"1m\"\n",
            "match = { channels = [\"fold-test-push\"], categories = [\"fold-test-news\"] }\n",
        )));
        let before = |out: &str, series: &str| sample(out, series).unwrap_or(0.0);
        let other =
            r#"sendquota_decisions_total{outcome="in_flight",channel="other",category="other"}"#;
        let named = r#"sendquota_decisions_total{outcome="in_flight",channel="fold-test-push",category="fold-test-news"}"#;
        let out = handle.render();
        let (other_before, named_before) = (before(&out, other), before(&out, named));
        m.outcome(
            OutcomeName::InFlight,
            Some(&request("fold-test-pigeon", "fold-test-gossip")),
        );
        m.outcome(OutcomeName::InFlight, None);
        m.outcome(
            OutcomeName::InFlight,
            Some(&request("fold-test-push", "fold-test-news")),
        );
        let out = handle.render();
        assert_eq!(sample(&out, other), Some(other_before + 2.0));
        assert_eq!(sample(&out, named), Some(named_before + 1.0));
        assert!(!out.contains("fold-test-pigeon") && !out.contains("fold-test-gossip"));
    }

    #[test]
    fn every_family_is_described_and_exported_before_it_counts() {
        let handle = prometheus();
        let _registered = MessageMetrics::register(&policy(""));
        let out = handle.render();
        for family in FAMILIES {
            let kind = match family.kind {
                MetricKind::Counter => "counter",
                MetricKind::Gauge => "gauge",
                MetricKind::Histogram => "histogram",
            };
            assert!(
                out.contains(&format!("# HELP {} {}\n", family.name, family.help)),
                "{} has no help line in\n{out}",
                family.name
            );
            assert!(
                out.contains(&format!("# TYPE {} {kind}\n", family.name)),
                "{} is not exported as a {kind} in\n{out}",
                family.name
            );
        }
    }

    #[test]
    fn counters_alone_end_in_total_and_durations_are_in_seconds() {
        for family in FAMILIES {
            let total = family.name.ends_with("_total");
            assert_eq!(
                total,
                family.kind == MetricKind::Counter,
                "{}: `_total` is for counters, and every counter has it",
                family.name
            );
            assert!(
                !family.name.ends_with("_ms") && family.name.starts_with("sendquota_"),
                "{}",
                family.name
            );
        }
    }

    #[test]
    fn a_hashed_recipient_is_its_hmac_sha256_in_hex() {
        struct Shown<'a>(&'a Recipients, &'a str);
        impl fmt::Display for Shown<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.write(self.1, f)
            }
        }
        // RFC 4231, test case 2.
        let key = hmac::Hmac::new_from_slice(b"Jefe").expect("any key length");
        let hashed = Recipients::Hashed(key);
        assert_eq!(
            Shown(&hashed, "what do ya want for nothing?").to_string(),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(Shown(&Recipients::Plain, "alice").to_string(), "alice");
    }
}
