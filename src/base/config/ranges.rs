//! Every numeric setting with the range the worker can run with, in one list: validation walks
//! it, a refused value's message quotes it, a TOML value its type cannot hold is refused with
//! it, and the tests hold the example file to it.

use super::{ConfigError, Settings};
use crate::request::message::one_line;

/// Most runtime threads a worker may ask for: far beyond any useful count, low enough that a
/// typo cannot make the process try to start millions of threads.
const MAX_THREADS: usize = 1024;

/// One numeric setting and the range the worker can run with. The one list of them,
/// [`NUMERIC_SETTINGS`], is what validation walks, what a refused value's message quotes, and
/// what the tests walk, so a setting cannot be added without a range.
#[derive(Debug)]
pub struct NumericSetting {
    /// The table the setting is in (`worker` for `[worker]`).
    pub section: &'static str,
    /// The key within the table.
    pub key: &'static str,
    /// Smallest value accepted.
    pub min: u64,
    /// Largest value accepted.
    pub max: u64,
    value: fn(&Settings) -> u64,
}

impl NumericSetting {
    /// The one line that refuses `got` (a value as written, or a number) for this setting.
    pub(super) fn refusal(&self, got: &dyn std::fmt::Display) -> ConfigError {
        ConfigError::Invalid(format!(
            "[{}] {} must be between {} and {} (got {})",
            self.section,
            self.key,
            self.min,
            self.max,
            one_line(&got.to_string())
        ))
    }
}

/// Most request shards: each is a quorum queue with a consumer on every worker, so far more
/// queues than workers only multiplies the broker's work; 64 leaves room to grow.
pub(super) const MAX_SHARDS: u64 = 64;

/// Ten minutes: the longest timeout or interval accepted. Longer ones only hide a failure (a
/// wait that long is a service that is down), and bounds keep every duration far from what
/// `Duration` and tokio's timers can hold.
const MAX_WAIT_MS: u64 = 600_000;

/// An hour: the longest lease, shutdown wait, watchdog interval or slot yield accepted.
const MAX_LONG_WAIT_MS: u64 = 3_600_000;

/// Every numeric setting with its valid range, stated beside it in deploy/config.example.toml.
pub const NUMERIC_SETTINGS: [NumericSetting; 22] = [
    // Below 100 ms a loaded but healthy Redis times out.
    NumericSetting {
        section: "redis",
        key: "response_timeout_ms",
        min: 100,
        max: MAX_WAIT_MS,
        value: |s| s.redis.response_timeout_ms,
    },
    // A master has a handful of replicas at most; 0 turns the wait off.
    NumericSetting {
        section: "redis",
        key: "wait_replicas",
        min: 0,
        max: 16,
        value: |s| u64::from(s.redis.wait_replicas),
    },
    // Each committing call waits this long at most, so it stays well below the response
    // timeout that bounds the whole call.
    NumericSetting {
        section: "redis",
        key: "wait_timeout_ms",
        min: 1,
        max: 10_000,
        value: |s| s.redis.wait_timeout_ms,
    },
    // 0 would be "unlimited" in AMQP: refused, so the worker's memory stays bounded by it.
    NumericSetting {
        section: "amqp",
        key: "prefetch",
        min: 1,
        max: u16::MAX as u64,
        value: |s| u64::from(s.amqp.prefetch),
    },
    // 1 = the one requests queue, as before shards existed.
    NumericSetting {
        section: "intake",
        key: "shards",
        min: 1,
        max: MAX_SHARDS,
        value: |s| u64::from(s.intake.shards),
    },
    NumericSetting {
        section: "database",
        key: "max_connections",
        min: 1,
        max: 1_000,
        value: |s| u64::from(s.database.max_connections),
    },
    NumericSetting {
        section: "database",
        key: "acquire_timeout_ms",
        min: 100,
        max: MAX_WAIT_MS,
        value: |s| s.database.acquire_timeout_ms,
    },
    // Postgres reads 0 as "no timeout": refused, a stuck query must free its connection.
    NumericSetting {
        section: "database",
        key: "statement_timeout_ms",
        min: 100,
        max: MAX_WAIT_MS,
        value: |s| s.database.statement_timeout_ms,
    },
    // 0 = one per CPU.
    NumericSetting {
        section: "worker",
        key: "threads",
        min: 0,
        max: MAX_THREADS as u64,
        value: |s| s.worker.threads as u64,
    },
    // The most deliveries the broker can hand over at once (the largest prefetch).
    NumericSetting {
        section: "worker",
        key: "concurrency",
        min: 1,
        max: u16::MAX as u64,
        value: |s| s.worker.concurrency as u64,
    },
    // The smallest valid request fits in 256 bytes; RabbitMQ refuses bodies over 128 MiB.
    NumericSetting {
        section: "worker",
        key: "max_body_bytes",
        min: 256,
        max: 128 * 1024 * 1024,
        value: |s| s.worker.max_body_bytes as u64,
    },
    // At least an hour, so a redelivery is recognised; at most the longest rule window.
    NumericSetting {
        section: "worker",
        key: "dedup_ttl_secs",
        min: 3_600,
        max: 366 * 86_400,
        value: |s| s.worker.dedup_ttl_secs,
    },
    // Renewed every third of the lease: at 300 ms, every 100 ms.
    NumericSetting {
        section: "worker",
        key: "claim_lease_ms",
        min: 300,
        max: MAX_LONG_WAIT_MS,
        value: |s| s.worker.claim_lease_ms,
    },
    NumericSetting {
        section: "worker",
        key: "retry_initial_ms",
        min: 1,
        max: MAX_WAIT_MS,
        value: |s| s.worker.retry_initial_ms,
    },
    NumericSetting {
        section: "worker",
        key: "retry_max_ms",
        min: 1,
        max: MAX_WAIT_MS,
        value: |s| s.worker.retry_max_ms,
    },
    NumericSetting {
        section: "worker",
        key: "shutdown_timeout_ms",
        min: 100,
        max: MAX_LONG_WAIT_MS,
        value: |s| s.worker.shutdown_timeout_ms,
    },
    // Rows are bound as one array per column (12 parameters whatever the size); the bound
    // keeps one transaction, and the writer's queue of four batches, small.
    NumericSetting {
        section: "worker",
        key: "denial_batch_size",
        min: 1,
        max: 10_000,
        value: |s| s.worker.denial_batch_size as u64,
    },
    // 0 = write what has arrived without waiting; a denial's message waits this long at most.
    NumericSetting {
        section: "worker",
        key: "denial_batch_wait_ms",
        min: 0,
        max: 1_000,
        value: |s| s.worker.denial_batch_wait_ms,
    },
    NumericSetting {
        section: "worker",
        key: "watchdog_interval_ms",
        min: 100,
        max: MAX_LONG_WAIT_MS,
        value: |s| s.worker.watchdog_interval_ms,
    },
    NumericSetting {
        section: "worker",
        key: "yield_slot_after_ms",
        min: 100,
        max: MAX_LONG_WAIT_MS,
        value: |s| s.worker.yield_slot_after_ms,
    },
    // Below 100 ms the flusher's queries on an idle table are most of the worker's work.
    NumericSetting {
        section: "worker",
        key: "digest_flush_interval_ms",
        min: 100,
        max: MAX_LONG_WAIT_MS,
        value: |s| s.worker.digest_flush_interval_ms,
    },
    // Below 1 KiB most digests would carry one message; RabbitMQ refuses bodies over 128 MiB.
    NumericSetting {
        section: "worker",
        key: "max_digest_bytes",
        min: 1_024,
        max: 128 * 1024 * 1024,
        value: |s| s.worker.max_digest_bytes as u64,
    },
];

/// Every numeric setting within its range, and the backoff growing from its first delay.
pub(super) fn check_ranges(settings: &Settings) -> Result<(), ConfigError> {
    for setting in &NUMERIC_SETTINGS {
        let value = (setting.value)(settings);
        if !(setting.min..=setting.max).contains(&value) {
            return Err(setting.refusal(&value));
        }
    }
    let w = &settings.worker;
    if w.retry_initial_ms > w.retry_max_ms {
        return Err(ConfigError::Invalid(format!(
            "[worker] retry_initial_ms ({}) must be at most retry_max_ms ({})",
            w.retry_initial_ms, w.retry_max_ms
        )));
    }
    Ok(())
}

/// The numeric setting whose value (not key) is at byte `at` of `text`, and the value as
/// written: `key = value` on that line, in the table the last `[header]` above it opens (or
/// written as a dotted key).
pub(super) fn numeric_value_at(text: &str, at: usize) -> Option<(&'static NumericSetting, &str)> {
    let at = (0..=at.min(text.len()))
        .rev()
        .find(|i| text.is_char_boundary(*i))?;
    let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let end = text[at..].find('\n').map_or(text.len(), |i| at + i);
    let line = &text[start..end];
    let equals = line.find('=')?;
    if at < start + equals {
        return None;
    }
    let header = text[..start]
        .lines()
        .rev()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .find(|l| l.starts_with('['))
        .map_or("", |h| h.trim_matches(|c| c == '[' || c == ']').trim());
    let key = line[..equals].trim();
    let path: Vec<&str> = header
        .split('.')
        .chain(key.split('.'))
        .map(|p| p.trim().trim_matches('"'))
        .filter(|p| !p.is_empty())
        .collect();
    let [section, key] = path[..] else {
        return None;
    };
    let setting = NUMERIC_SETTINGS
        .iter()
        .find(|s| s.section == section && s.key == key)?;
    let value = line[equals + 1..].split('#').next().unwrap_or("").trim();
    Some((setting, value))
}
