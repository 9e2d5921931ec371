//! Settings: a TOML file, then environment overrides for connections and namespace.
//!
//! Everything is validated here, before any connection is opened, so a bad file stops the
//! process at start-up with one clear line instead of failing on the first message. The
//! tables and their defaults are in `sections`, the environment's overrides in `env`, every
//! numeric setting's range in `ranges` and the other checks in `checks`.

mod checks;
mod env;
mod ranges;
mod sections;

use std::path::{Path, PathBuf};

use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use crate::request::message::one_line;
use crate::rules::policy::{Policy, PolicyError, RawRule};
use checks::{check_admin, check_namespace, check_urls};
use env::{apply_env, apply_intake_env, check_log, check_telemetry};
use ranges::{check_ranges, numeric_value_at};
pub use ranges::{NumericSetting, NUMERIC_SETTINGS};
pub use sections::{
    AdminSettings, AdminToken, AmqpSettings, DatabaseSettings, IntakeSettings, LogFormat,
    LogSettings, QueueType, RecipientKey, RecipientLog, RedisSettings, TelemetrySettings,
    WorkerSettings, DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL, DEFAULT_MAX_DIGEST_BYTES,
    DEFAULT_NAMESPACE, DEFAULT_REDIS_URL,
};

/// Why the configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file named by `--config` or `SENDQUOTA_CONFIG`.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// `default_timezone` is not an IANA zone.
    #[error("default_timezone: unknown time zone \"{0}\"")]
    UnknownTimeZone(String),
    /// The namespace cannot be used in queue and key names.
    #[error("namespace \"{0}\" must be 1 to 64 characters of letters, digits, '_', '-' and '.'")]
    BadNamespace(String),
    /// A setting is out of range.
    #[error("{0}")]
    Invalid(String),
    /// A rule is invalid.
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

/// Everything the process needs, validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Prefix of every exchange, queue and Redis key name.
    pub namespace: String,
    /// Redis connection.
    pub redis: RedisSettings,
    /// RabbitMQ connection and topology.
    pub amqp: AmqpSettings,
    /// How requests come in (one queue or ordered shards).
    pub intake: IntakeSettings,
    /// Postgres connection.
    pub database: DatabaseSettings,
    /// Worker behaviour.
    pub worker: WorkerSettings,
    /// The admin HTTP API.
    pub admin: AdminSettings,
    /// Log lines: their format, and how decision logs show recipients.
    pub log: LogSettings,
    /// Span export.
    pub telemetry: TelemetrySettings,
    /// The validated rules.
    pub policy: Policy,
    /// The file these settings were read from (`None`: no file): a rule reload
    /// (`crate::rules::reload`) reads the same file again.
    pub source: Option<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct File {
    namespace: Option<String>,
    default_timezone: Option<String>,
    #[serde(default)]
    redis: RedisSettings,
    #[serde(default)]
    amqp: AmqpSettings,
    #[serde(default)]
    intake: IntakeSettings,
    #[serde(default)]
    database: DatabaseSettings,
    #[serde(default)]
    worker: WorkerSettings,
    #[serde(default)]
    admin: AdminSettings,
    #[serde(default)]
    log: LogSettings,
    #[serde(default)]
    telemetry: TelemetrySettings,
    #[serde(default)]
    rules: Vec<RawRule>,
}

impl Settings {
    /// Reads the file (if any), applies environment overrides from `env`, validates.
    pub fn load(
        path: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Settings, ConfigError> {
        let file = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_owned(),
                    source,
                })?;
                toml::from_str::<File>(&text).map_err(|e| parse_error(path, &text, &e))?
            }
            None => File::default(),
        };
        let mut settings = Settings::from_file(file, env)?;
        settings.source = path.map(Path::to_owned);
        Ok(settings)
    }

    /// Parses settings from TOML text (no file), with environment overrides.
    pub fn from_toml(
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Settings, ConfigError> {
        let file = toml::from_str::<File>(text)
            .map_err(|e| parse_error(Path::new("<inline>"), text, &e))?;
        Settings::from_file(file, env)
    }

    fn from_file(
        mut file: File,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Settings, ConfigError> {
        apply_env(&mut file, &env);
        apply_intake_env(&mut file.intake, &env)?;
        check_admin(&file.admin)?;
        check_log(&mut file.log, &env)?;
        check_telemetry(&mut file.telemetry, &env)?;
        let namespace = env("SENDQUOTA_NAMESPACE")
            .or(file.namespace)
            .unwrap_or_else(|| DEFAULT_NAMESPACE.to_owned());
        check_namespace(&namespace)?;
        let zone_name = file.default_timezone.unwrap_or_else(|| "UTC".to_owned());
        let zone: Tz = zone_name
            .parse()
            .map_err(|_| ConfigError::UnknownTimeZone(one_line(&zone_name)))?;
        check_urls(&file.redis, &file.amqp, &file.database)?;
        for (section, files) in [
            ("redis.tls", &file.redis.tls),
            ("amqp.tls", &file.amqp.tls),
            ("database.tls", &file.database.tls),
        ] {
            files.check().map_err(|e| {
                ConfigError::Invalid(format!("{section}: {}", one_line(&e.to_string())))
            })?;
        }
        let policy = Policy::from_raw(zone, file.rules)?;
        let settings = Settings {
            namespace,
            redis: file.redis,
            amqp: file.amqp,
            intake: file.intake,
            database: file.database,
            worker: file.worker,
            admin: file.admin,
            log: file.log,
            telemetry: file.telemetry,
            policy,
            source: None,
        };
        check_ranges(&settings)?;
        Ok(settings)
    }
}

impl Settings {
    /// The effective configuration as TOML, connection passwords redacted (`config check`).
    pub fn effective_toml(&self) -> String {
        #[derive(Serialize)]
        struct Effective<'a> {
            namespace: &'a str,
            default_timezone: &'a str,
            redis: RedisSettings,
            amqp: AmqpSettings,
            intake: &'a IntakeSettings,
            database: DatabaseSettings,
            worker: &'a WorkerSettings,
            admin: &'a AdminSettings,
            log: &'a LogSettings,
            telemetry: TelemetrySettings,
            rules: &'a [crate::rules::policy::Rule],
        }
        let mut redis = self.redis.clone();
        redis.url = redact_url(&redis.url);
        redis.cluster_urls = redis.cluster_urls.iter().map(|u| redact_url(u)).collect();
        let mut amqp = self.amqp.clone();
        amqp.url = redact_url(&amqp.url);
        amqp.urls = amqp.urls.iter().map(|u| redact_url(u)).collect();
        let mut database = self.database.clone();
        database.url = redact_url(&database.url);
        database.read_url = redact_url(&database.read_url);
        let effective = Effective {
            namespace: &self.namespace,
            default_timezone: self.policy.default_zone.name(),
            redis,
            amqp,
            intake: &self.intake,
            database,
            worker: &self.worker,
            admin: &self.admin,
            log: &self.log,
            telemetry: TelemetrySettings {
                otlp_endpoint: redact_url(&self.telemetry.otlp_endpoint),
            },
            rules: &self.policy.rules,
        };
        toml::to_string(&effective).unwrap_or_else(|e| format!("# cannot print settings: {e}\n"))
    }
}

/// A TOML error as one line. A numeric setting's value that its type cannot hold (negative,
/// beyond the type, beyond TOML's integers, not a whole number) is refused with the setting's
/// range, as a value out of range is; anything else says where, then what.
fn parse_error(path: &Path, text: &str, e: &toml::de::Error) -> ConfigError {
    let numeric = e.span().and_then(|span| numeric_value_at(text, span.start));
    match numeric {
        Some((setting, written)) => setting.refusal(&written),
        None => ConfigError::Parse {
            path: path.to_owned(),
            message: parse_message(text, e),
        },
    }
}

/// A TOML error as one line: where, then what.
fn parse_message(text: &str, e: &toml::de::Error) -> String {
    match e.span() {
        Some(span) => {
            let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
            format!("line {line}: {}", one_line(e.message()))
        }
        None => one_line(e.message()),
    }
}

/// A URL with its password (user-info or `password=` parameter) replaced by `***`, for logs
/// and `config check`.
pub fn redact_url(url: &str) -> String {
    let url = redact_userinfo(url);
    match url.find("password=") {
        Some(start) => {
            let value = start + "password=".len();
            let end = url[value..].find('&').map_or(url.len(), |e| value + e);
            format!("{}***{}", &url[..value], &url[end..])
        }
        None => url,
    }
}

fn redact_userinfo(url: &str) -> String {
    // Whatever precedes the first '@' is user information; the password is after its last
    // ':' (past any "scheme://"). Redacting too much is harmless, too little is not.
    let Some(at) = url.find('@') else {
        return url.to_owned();
    };
    let start = url[..at].find("://").map_or(0, |i| i + 3);
    match url[start..at].rfind(':') {
        Some(colon) => format!("{}:***{}", &url[..start + colon], &url[at..]),
        None if start == 0 => format!("***{}", &url[at..]),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn no_file_means_the_headline_rule_in_utc() {
        let s = Settings::load(None, no_env).unwrap();
        assert_eq!(s.namespace, "sendquota");
        assert_eq!(s.policy.rules.len(), 1);
        assert_eq!(s.policy.rules[0].name, "headline");
        assert_eq!(s.policy.default_zone, chrono_tz::UTC);
    }

    #[test]
    fn environment_overrides_connection_settings_and_namespace() {
        let env = |k: &str| match k {
            "SENDQUOTA_REDIS_URL" => Some("redis://elsewhere:1".to_owned()),
            "SENDQUOTA_NAMESPACE" => Some("t1".to_owned()),
            _ => None,
        };
        let s =
            Settings::from_toml("namespace = \"file\"\n[redis]\nurl = \"redis://x\"", env).unwrap();
        assert_eq!(s.redis.url, "redis://elsewhere:1");
        assert_eq!(s.namespace, "t1");
    }

    #[test]
    fn passwords_are_redacted_from_urls() {
        assert_eq!(
            redact_url("amqp://guest:secret@host:5672/%2f"),
            "amqp://guest:***@host:5672/%2f"
        );
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(
            redact_url("postgres://u@h/db?password=x&sslmode=off"),
            "postgres://u@h/db?password=***&sslmode=off"
        );
    }

    #[test]
    fn the_example_config_is_valid_and_states_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/config.example.toml");
        let s = Settings::load(Some(&path), no_env).unwrap();
        let defaults = Settings::load(None, no_env).unwrap();
        assert_eq!(s.policy.rules, defaults.policy.rules);
        assert_eq!(s.worker.dedup_ttl_secs, defaults.worker.dedup_ttl_secs);
        assert_eq!(s.amqp.prefetch, defaults.amqp.prefetch);
        assert_eq!(s.worker.threads, defaults.worker.threads);
        let text = std::fs::read_to_string(&path).unwrap();
        for setting in &NUMERIC_SETTINGS {
            let (min, max) = (setting.min, setting.max);
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("{} = ", setting.key))
                        && l.contains(&format!("# {min} to {max}"))),
                "the example states the range of {}",
                setting.key
            );
        }
    }

    #[test]
    fn a_value_its_type_cannot_hold_is_refused_with_the_setting_s_range() {
        for (text, got) in [
            ("[database]\nmax_connections = -1 # none\n", "-1"),
            (
                "[database]\nmax_connections = 99999999999999999999\n",
                "99999999999999999999",
            ),
            ("database.max_connections = 1e30\n", "1e30"),
            ("[database]\nmax_connections = \"8\"\n", "\"8\""),
        ] {
            assert_eq!(
                Settings::from_toml(text, no_env).unwrap_err().to_string(),
                format!("[database] max_connections must be between 1 and 1000 (got {got})"),
                "{text}"
            );
        }
        let twice = "[database]\nmax_connections = 2\nmax_connections = 3\n";
        let duplicate = Settings::from_toml(twice, no_env).unwrap_err().to_string();
        assert!(
            duplicate.starts_with("config file <inline>: line 3: "),
            "{duplicate}"
        );
    }

    #[test]
    fn json_logs_are_chosen_by_the_file_or_the_environment_which_wins() {
        let file = "[log]\nformat = \"json\"\n";
        assert_eq!(
            Settings::from_toml(file, no_env).unwrap().log.format,
            LogFormat::Json
        );
        let text = |k: &str| (k == "SENDQUOTA_LOG_FORMAT").then(|| "text".to_owned());
        assert_eq!(
            Settings::from_toml(file, text).unwrap().log.format,
            LogFormat::Text
        );
        let xml = |k: &str| (k == "SENDQUOTA_LOG_FORMAT").then(|| "xml".to_owned());
        assert_eq!(
            Settings::from_toml("", xml).unwrap_err().to_string(),
            "SENDQUOTA_LOG_FORMAT \"xml\" is not text or json"
        );
        let err = Settings::from_toml("[log]\nformat = \"xml\"\n", no_env).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("config file <inline>: line 2: unknown variant `xml`"),
            "{err}"
        );
    }

    #[test]
    fn hashed_recipients_need_a_key_from_the_environment_that_is_never_printed() {
        let file = "[log]\nrecipient = \"hash\"\n";
        assert_eq!(
            Settings::from_toml(file, no_env).unwrap_err().to_string(),
            "[log] recipient = \"hash\" needs SENDQUOTA_LOG_RECIPIENT_KEY, at least 16 characters"
        );
        let short = |k: &str| (k == "SENDQUOTA_LOG_RECIPIENT_KEY").then(|| "short".to_owned());
        assert!(Settings::from_toml(file, short).is_err());
        let secret = "log-key-0123456789-secret";
        let keyed = |k: &str| (k == "SENDQUOTA_LOG_RECIPIENT_KEY").then(|| secret.to_owned());
        let settings = Settings::from_toml(file, keyed).unwrap();
        assert_eq!(settings.log.recipient, RecipientLog::Hash);
        assert_eq!(settings.log.recipient_key.0, secret);
        assert!(!settings.effective_toml().contains(secret));
        assert!(!format!("{settings:?}").contains(secret));
        let in_file = "[log]\nrecipient_key = \"log-key-0123456789-secret\"\n";
        assert!(
            Settings::from_toml(in_file, no_env).is_err(),
            "the key is not read from the file"
        );
    }

    #[test]
    fn span_export_is_off_by_default_and_its_endpoint_comes_from_the_file_or_the_environment() {
        assert_eq!(
            Settings::load(None, no_env).unwrap().telemetry.traces_url(),
            None
        );
        let file = "[telemetry]\notlp_endpoint = \"http://collector:4318/\"\n";
        let from_file = Settings::from_toml(file, no_env).unwrap();
        assert_eq!(
            from_file.telemetry.traces_url().as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        let standard = |k: &str| {
            (k == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| "http://standard:4318".to_owned())
        };
        let ours = |k: &str| match k {
            "SENDQUOTA_OTLP_ENDPOINT" => Some("http://ours:4318".to_owned()),
            _ => standard(k),
        };
        let endpoint = |env: &dyn Fn(&str) -> Option<String>| {
            Settings::from_toml(file, env)
                .unwrap()
                .telemetry
                .otlp_endpoint
        };
        // The platform-wide variable is not ours to follow.
        assert_eq!(endpoint(&standard), "http://collector:4318/");
        assert_eq!(endpoint(&ours), "http://ours:4318");
        let printed = from_file.effective_toml();
        assert!(
            printed.contains("[telemetry]\notlp_endpoint = \"http://collector:4318/\""),
            "{printed}"
        );
    }

    #[test]
    fn an_otlp_endpoint_that_is_not_plain_http_is_refused_naming_its_source() {
        let https =
            |k: &str| (k == "SENDQUOTA_OTLP_ENDPOINT").then(|| "https://collector:4318".to_owned());
        let platform_https = |k: &str| {
            (k == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| "https://collector:4318".to_owned())
        };
        assert!(Settings::from_toml("", platform_https).is_ok(), "not read");
        assert_eq!(
            Settings::from_toml("", https).unwrap_err().to_string(),
            "SENDQUOTA_OTLP_ENDPOINT \"https://collector:4318\" is not an http:// URL such \
             as http://127.0.0.1:4318 (spans are exported over plain HTTP only: run the collector \
             beside the worker)"
        );
        let file = "[telemetry]\notlp_endpoint = \"collector:4318\"\n";
        let err = Settings::from_toml(file, no_env).unwrap_err().to_string();
        assert!(
            err.starts_with("[telemetry] otlp_endpoint \"collector:4318\""),
            "{err}"
        );
    }

    #[test]
    fn a_namespace_with_a_colon_is_refused() {
        let env = |k: &str| (k == "SENDQUOTA_NAMESPACE").then(|| "a:b".to_owned());
        let err = Settings::load(None, env).unwrap_err();
        assert_eq!(
            err.to_string(),
            "namespace \"a:b\" must be 1 to 64 characters of letters, digits, '_', '-' and '.'"
        );
    }
}
