//! Live rule changes: the running rules as one value swapped whole, reloaded from the
//! configuration file on SIGHUP or `POST /v1/rules/reload`, and every applied change audited.
//!
//! A message decides under one [`Rules`] snapshot, taken once at the start of its decision: the
//! policy and everything derived from it (the per-message metric handles, the policy's hash)
//! travel together, so a reload in the middle of a decision cannot mix two policies. Taking a
//! snapshot is a read lock and one `Arc` clone.
//!
//! A reload reads the file the worker started with through the same loader and validation as
//! start-up and `config check`; a file that does not load leaves the running rules in place.
//! Only the rules part (`default_timezone`, `[[rules]]`) is applied: other settings need a
//! restart, which the reload says. Quota state lives in Redis under keys named by rule and kind
//! (`keys`), so a rule that keeps its name and kind keeps its counters, whatever else changed.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::base::config::{ConfigError, Settings};
use crate::base::telemetry::{self, MessageMetrics};
use crate::decide::deny_cache::DenyCache;
use crate::record::denials::DenialStore;
use crate::rules::policy::{Policy, Rule};

/// The rules one decision runs under: the policy and what is derived from it, built together
/// so they always agree.
pub struct Rules {
    /// The validated policy.
    pub policy: Policy,
    /// The per-message metric handles, labelled by this policy's rules and match lists.
    pub metrics: MessageMetrics,
    /// [`policy_hash`] of `policy`: what audits and logs name the rules by.
    pub hash: String,
}

impl Rules {
    /// Builds the rules and their derived state from a validated policy.
    pub fn new(policy: Policy) -> Rules {
        Rules {
            metrics: MessageMetrics::register(&policy),
            hash: policy_hash(&policy),
            policy,
        }
    }
}

/// The running rules, shared by the pipeline and the admin API. Cloning shares them.
#[derive(Clone)]
pub struct LiveRules(Arc<RwLock<Arc<Rules>>>);

impl LiveRules {
    /// Running `rules` until replaced.
    pub fn new(rules: Rules) -> LiveRules {
        LiveRules(Arc::new(RwLock::new(Arc::new(rules))))
    }

    /// The rules now: one snapshot, to be used for a whole decision.
    pub fn current(&self) -> Arc<Rules> {
        // A poisoned lock still holds a whole Arc: the swap is a single assignment.
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the rules; returns the ones replaced.
    fn swap(&self, rules: Rules) -> Arc<Rules> {
        let mut running = self.0.write().unwrap_or_else(|p| p.into_inner());
        std::mem::replace(&mut *running, Arc::new(rules))
    }
}

/// The policy as the TOML `config check` prints for it (`default_timezone` and `[[rules]]`):
/// canonical, so equal policies print the same text whatever the file's layout.
pub fn policy_toml(policy: &Policy) -> String {
    #[derive(Serialize)]
    struct Canonical<'a> {
        default_timezone: &'a str,
        rules: &'a [Rule],
    }
    toml::to_string(&Canonical {
        default_timezone: policy.default_zone.name(),
        rules: &policy.rules,
    })
    .unwrap_or_else(|e| format!("# cannot print the policy: {e}\n"))
}

/// SHA-256 of [`policy_toml`], in lowercase hex: names a policy in audits and logs, and tells
/// a reload that changes nothing.
pub fn policy_hash(policy: &Policy) -> String {
    Sha256::digest(policy_toml(policy).as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What a reload changed, one line per change, for people: a changed zone, each added rule
/// with its settings, each removed rule, each changed rule with its changed settings
/// (`setting old -> new`), and the order of the rules kept when it changed (the first refusing
/// rule in that order names a denial).
pub fn diff(old: &Policy, new: &Policy) -> Vec<String> {
    let mut lines = Vec::new();
    if old.default_zone != new.default_zone {
        lines.push(format!(
            "default_timezone: {} -> {}",
            old.default_zone.name(),
            new.default_zone.name()
        ));
    }
    for rule in &new.rules {
        let fields = settings_of(rule);
        match old.rule(&rule.name) {
            None => {
                let all: Vec<String> = fields.iter().map(|(k, v)| format!("{k} = {v}")).collect();
                lines.push(format!("+ rule {}: {}", rule.name, all.join(", ")));
            }
            Some(before) if before != rule => {
                let before = settings_of(before);
                let mut keys: Vec<&String> = before.keys().chain(fields.keys()).collect();
                keys.sort();
                keys.dedup();
                let shown =
                    |v: Option<&toml::Value>| v.map_or("(none)".to_owned(), |v| v.to_string());
                let changed: Vec<String> = keys
                    .into_iter()
                    .filter(|k| before.get(*k) != fields.get(*k))
                    .map(|k| format!("{k} {} -> {}", shown(before.get(k)), shown(fields.get(k))))
                    .collect();
                lines.push(format!("~ rule {}: {}", rule.name, changed.join(", ")));
            }
            Some(_) => {}
        }
    }
    for rule in old.rules.iter().filter(|r| new.rule(&r.name).is_none()) {
        lines.push(format!("- rule {}", rule.name));
    }
    let kept = |from: &Policy, other: &Policy| -> Vec<String> {
        let names = from.rules.iter().map(|r| r.name.clone());
        names.filter(|n| other.rule(n).is_some()).collect()
    };
    let (before, after) = (kept(old, new), kept(new, old));
    if before != after {
        lines.push(format!(
            "order: {} -> {}",
            before.join(", "),
            after.join(", ")
        ));
    }
    lines
}

/// A rule's settings but its name, as `config check` prints them.
fn settings_of(rule: &Rule) -> toml::Table {
    let mut table = match toml::Table::try_from(rule) {
        Ok(table) => table,
        Err(e) => toml::Table::from_iter([("error".to_owned(), e.to_string().into())]),
    };
    table.remove("name");
    table
}

/// Who asked for a reload: what the audit row's `source` says.
#[derive(Debug, Clone)]
pub enum Source {
    /// SIGHUP.
    Signal,
    /// The admin API, with the token's name (never the token).
    Api(String),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Signal => f.write_str("signal"),
            Source::Api(name) => write!(f, "api:{name}"),
        }
    }
}

/// Why a reload did not apply; the running rules stay.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file does not load or validate: the one line start-up would print, less the
    /// file's path (see [`without_path`]).
    #[error("{0}")]
    Invalid(String),
    /// The change could not be recorded in `policy_changes`, so it was not applied: no change
    /// goes unaudited.
    #[error("the rules were not changed: the audit row could not be written: {0}")]
    Audit(String),
}

/// What a reload that applied came to.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Reloaded {
    /// The rules changed, recorded as row `id` of `policy_changes`.
    Applied {
        /// The audit row.
        id: i64,
        /// Hash of the rules replaced.
        old_hash: String,
        /// Hash of the rules now running.
        new_hash: String,
        /// [`diff`]'s lines.
        diff: Vec<String>,
        /// Top-level settings of the file that differ from the running ones and are not
        /// applied until a restart.
        restart_needed: Vec<String>,
    },
    /// The file's rules are the running ones: nothing applied, nothing recorded.
    Unchanged {
        /// Hash of the running rules.
        hash: String,
        /// As for `Applied`.
        restart_needed: Vec<String>,
    },
}

/// How often a reload looks whether messages decided under the replaced rules are still in
/// flight, to turn the deny cache back on.
const DRAIN_POLL: Duration = Duration::from_millis(100);

/// Reloads the rules from the configuration file: one reload at a time.
pub struct Reloader {
    live: LiveRules,
    /// The file the worker started with (`None`: none, so the headline rule).
    source: Option<PathBuf>,
    /// The settings but the rules as the worker started, as `config check` prints them.
    started_with: toml::Table,
    store: DenialStore,
    cache: Option<Arc<DenyCache>>,
    one_at_a_time: tokio::sync::Mutex<()>,
}

impl Reloader {
    /// A reloader of `live`, started from `settings`, auditing in `store`, keeping `cache`
    /// exact across changes.
    pub fn new(
        live: LiveRules,
        settings: &Settings,
        store: DenialStore,
        cache: Option<Arc<DenyCache>>,
    ) -> Reloader {
        Reloader {
            live,
            source: settings.source.clone(),
            started_with: other_settings(settings),
            store,
            cache,
            one_at_a_time: tokio::sync::Mutex::new(()),
        }
    }

    /// The running rules.
    pub fn rules(&self) -> &LiveRules {
        &self.live
    }

    /// Reads the configuration file again and, when it is valid and its rules differ, records
    /// the change and runs the new rules. A failure is logged (one line), counted in
    /// [`telemetry::POLICY_RELOAD_FAILURES`] and returned; the running rules stay.
    pub async fn reload(&self, source: Source) -> Result<Reloaded, ReloadError> {
        let _one = self.one_at_a_time.lock().await;
        let reloaded = self.apply(&source).await;
        match &reloaded {
            Ok(Reloaded::Applied {
                old_hash,
                new_hash,
                diff,
                ..
            }) => info!(%source, %old_hash, %new_hash, diff = %diff.join("; "), "rules reloaded"),
            Ok(Reloaded::Unchanged { hash, .. }) => {
                info!(%source, %hash, "rules reloaded: unchanged")
            }
            Err(e) => {
                metrics::counter!(telemetry::POLICY_RELOAD_FAILURES).increment(1);
                let line = crate::request::message::one_line(&e.to_string());
                let file = self.source.as_deref().map(|p| p.display().to_string());
                let file = crate::request::message::one_line(&file.unwrap_or_default());
                error!(%source, %file, error = %line, "rules not reloaded; the running rules stay");
            }
        }
        reloaded
    }

    async fn apply(&self, source: &Source) -> Result<Reloaded, ReloadError> {
        let path = self.source.clone();
        let loaded = tokio::task::spawn_blocking(move || {
            Settings::load(path.as_deref(), |k| std::env::var(k).ok())
        })
        .await
        .map_err(|e| ReloadError::Invalid(format!("reading the configuration: {e}")))?
        .map_err(|e| ReloadError::Invalid(without_path(&e)))?;
        let restart_needed = self.restart_needed(&loaded);
        if !restart_needed.is_empty() {
            warn!(settings = %restart_needed.join(", "),
                "the configuration file changes settings a reload does not apply: restart to apply them");
        }
        let running = self.live.current();
        let next = Rules::new(loaded.policy);
        if next.hash == running.hash {
            return Ok(Reloaded::Unchanged {
                hash: next.hash,
                restart_needed,
            });
        }
        let diff = diff(&running.policy, &next.policy);
        let id = record(&self.store, source, &running.hash, &next.hash, &diff)
            .await
            .map_err(|e| ReloadError::Audit(e.to_string()))?;
        let new_hash = next.hash.clone();
        if let Some(cache) = &self.cache {
            cache.suspend();
        }
        let replaced = self.live.swap(next);
        drop(running);
        if let Some(cache) = self.cache.clone() {
            tokio::spawn(resume_when_drained(cache, replaced.clone()));
        }
        Ok(Reloaded::Applied {
            id,
            old_hash: replaced.hash.clone(),
            new_hash,
            diff,
            restart_needed,
        })
    }

    /// The top-level settings of `loaded` that differ from those the worker started with.
    fn restart_needed(&self, loaded: &Settings) -> Vec<String> {
        let now = other_settings(loaded);
        let mut keys: Vec<String> = self
            .started_with
            .keys()
            .chain(now.keys())
            .filter(|k| self.started_with.get(*k) != now.get(*k))
            .cloned()
            .collect();
        keys.sort();
        keys.dedup();
        keys
    }
}

/// What a reload's caller is told of a file that does not load: start-up's line without the
/// file's path. The caller holds an admin token, not a shell on the host: where the worker's
/// files live is not theirs to learn from an error (the log line names the file).
fn without_path(e: &ConfigError) -> String {
    match e {
        ConfigError::Read { source, .. } => format!("cannot read the config file: {source}"),
        ConfigError::Parse { message, .. } => format!("config file: {message}"),
        other => other.to_string(),
    }
}

/// The settings `config check` prints, but the rules part.
fn other_settings(settings: &Settings) -> toml::Table {
    let mut table: toml::Table = settings.effective_toml().parse().unwrap_or_default();
    table.remove("default_timezone");
    table.remove("rules");
    table
}

/// Turns the deny cache back on once no message decided under `replaced` is in flight (this
/// task holds the last reference). Until then a cached denial could be filled under the old
/// rules and answer under the new ones, or an admission under the old rules could change state
/// a denial cached under the new ones relies on without announcing it.
async fn resume_when_drained(cache: Arc<DenyCache>, replaced: Arc<Rules>) {
    while Arc::strong_count(&replaced) > 1 {
        tokio::time::sleep(DRAIN_POLL).await;
    }
    cache.resume();
}

/// SIGHUPs from now on, taken before the worker connects so that a SIGHUP during start-up waits
/// for [`reload_on_hangup`] instead of ending the process (the signal's default action).
/// `None` where there are no such signals or the handler could not be installed (logged): the
/// API still reloads.
pub fn hangups() -> Option<tokio::signal::unix::Signal> {
    use tokio::signal::unix::{signal, SignalKind};
    signal(SignalKind::hangup())
        .map_err(|e| warn!(error = %e, "no SIGHUP handler: reload the rules through the admin API"))
        .ok()
}

/// Reloads the rules on every SIGHUP of `hangups` until `stop`.
pub async fn reload_on_hangup(
    hangups: Option<tokio::signal::unix::Signal>,
    reloader: Arc<Reloader>,
    mut stop: watch::Receiver<bool>,
) {
    let Some(mut hangups) = hangups else {
        return;
    };
    loop {
        let hangup = tokio::select! {
            got = hangups.recv() => got.is_some(),
            _ = stop.wait_for(|s| *s) => false,
        };
        if !hangup {
            return;
        }
        let _ = reloader.reload(Source::Signal).await;
    }
}

/// One applied change, as `policy_changes` keeps it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct PolicyChange {
    /// Row id, increasing.
    pub id: i64,
    /// When it was applied.
    pub changed_at: DateTime<Utc>,
    /// `signal` or `api:<token name>`.
    pub source: String,
    /// Hash of the rules replaced.
    pub old_hash: String,
    /// Hash of the rules that replaced them.
    pub new_hash: String,
    /// [`diff`]'s lines, joined by newlines.
    pub diff: String,
}

/// Writes the audit row of a change about to be applied.
async fn record(
    store: &DenialStore,
    source: &Source,
    old_hash: &str,
    new_hash: &str,
    diff: &[String],
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO policy_changes (source, old_hash, new_hash, diff) \
         VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(source.to_string())
    .bind(old_hash)
    .bind(new_hash)
    .bind(diff.join("\n"))
    .fetch_one(store.pool())
    .await
}

/// The latest `limit` applied changes, newest first (`sendquota rules history`).
pub async fn history(pool: &sqlx::PgPool, limit: i64) -> Result<Vec<PolicyChange>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, changed_at, source, old_hash, new_hash, diff FROM policy_changes \
         ORDER BY id DESC LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(toml: &str) -> Policy {
        Settings::from_toml(toml, |_| None).expect("valid").policy
    }

    const HEADLINE: &str = "[[rules]]\nname = \"headline\"\nkind = \"calendar_quota\"\n";

    #[test]
    fn the_hash_is_the_canonical_toml_s_so_layout_does_not_change_it() {
        let spaced = "[[rules]]\n\nname   = \"headline\"\nkind = 'calendar_quota'\nper_day = 1\n";
        assert_eq!(policy_hash(&policy(HEADLINE)), policy_hash(&policy(spaced)));
        assert_eq!(policy_hash(&policy(HEADLINE)).len(), 64);
        let raised = format!("{HEADLINE}per_day = 2\n");
        assert_ne!(
            policy_hash(&policy(HEADLINE)),
            policy_hash(&policy(&raised))
        );
    }

    #[test]
    fn the_diff_names_each_added_removed_and_changed_rule_and_the_changed_settings() {
        let old = policy(&format!(
            "default_timezone = \"UTC\"\n{HEADLINE}\n[[rules]]\nname = \"night\"\n\
             kind = \"quiet_hours\"\nstart = \"22:00\"\nend = \"08:00\"\n"
        ));
        let new = policy(&format!(
            "default_timezone = \"Europe/Paris\"\n{HEADLINE}per_day = 2\n\n[[rules]]\n\
             name = \"burst\"\nkind = \"fixed_window\"\nlimit = 5\nwindow = \"1h\"\n"
        ));
        assert_eq!(
            diff(&old, &new),
            [
                "default_timezone: UTC -> Europe/Paris",
                "~ rule headline: per_day 1 -> 2",
                "+ rule burst: kind = \"fixed_window\", limit = 5, match = { categories = [], \
                 channels = [] }, on_deny = \"drop\", scope = \"recipient\", window = \"1h\"",
                "- rule night",
            ]
        );
        assert!(diff(&old, &old).is_empty());
    }

    #[test]
    fn a_new_order_of_the_rules_kept_is_a_change() {
        let a = "[[rules]]\nname = \"a\"\nkind = \"calendar_quota\"\n";
        let b = "[[rules]]\nname = \"b\"\nkind = \"calendar_quota\"\n";
        let old = policy(&format!("{a}{b}"));
        let new = policy(&format!("{b}{a}"));
        assert_eq!(diff(&old, &new), ["order: a, b -> b, a"]);
        assert_ne!(policy_hash(&old), policy_hash(&new));
    }
}
