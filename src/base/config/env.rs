//! The `SENDQUOTA_*` environment variables that override the file: a deployment keeps secrets
//! and addresses in the environment and the rest in the file. The log and span settings an
//! override can set are checked here too, so a refusal names the variable it came from.

use super::checks::MIN_TOKEN_CHARS;
use super::IntakeSettings;
use super::{redact_url, AdminToken, ConfigError, File, LogFormat, LogSettings, RecipientKey};
use super::{RecipientLog, TelemetrySettings};
use crate::base::tls::TlsFiles;
use crate::request::message::one_line;

/// The `SENDQUOTA_*` variables that override the file: each service's URL and TLS files, and
/// the admin API's address and an extra token. (A deployment keeps secrets and addresses in
/// the environment and the rest in the file.)
pub(super) fn apply_env(file: &mut File, env: &impl Fn(&str) -> Option<String>) {
    if let Some(url) = env("SENDQUOTA_REDIS_URL") {
        file.redis.url = url;
        file.redis.cluster_urls.clear();
    }
    if let Some(urls) = env("SENDQUOTA_REDIS_CLUSTER_URLS") {
        file.redis.cluster_urls = split_urls(&urls);
    }
    if let Some(url) = env("SENDQUOTA_AMQP_URL") {
        file.amqp.url = url;
        file.amqp.urls.clear();
    }
    if let Some(urls) = env("SENDQUOTA_AMQP_URLS") {
        file.amqp.urls = split_urls(&urls);
    }
    if let Some(url) = env("SENDQUOTA_DATABASE_URL") {
        file.database.url = url;
    }
    if let Some(url) = env("SENDQUOTA_DATABASE_READ_URL") {
        file.database.read_url = url;
    }
    for (service, files) in [
        ("REDIS", &mut file.redis.tls),
        ("AMQP", &mut file.amqp.tls),
        ("DATABASE", &mut file.database.tls),
    ] {
        tls_overrides(service, files, env);
    }
    if let Some(listen) = env("SENDQUOTA_ADMIN_LISTEN") {
        file.admin.listen = listen;
    }
    if let Some(token) = env("SENDQUOTA_ADMIN_TOKEN") {
        file.admin.tokens.push(AdminToken {
            name: "env".to_owned(),
            token,
        });
    }
}

/// A comma-separated list of URLs from one variable, blanks dropped.
fn split_urls(urls: &str) -> Vec<String> {
    urls.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `SENDQUOTA_INTAKE_SHARDS` overrides `[intake] shards`, so a deployment can move from one
/// queue to shards (docs/operations.md) by its environment; a value that is no number is
/// refused here, naming the variable, and its range is checked with the file's.
pub(super) fn apply_intake_env(
    intake: &mut IntakeSettings,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    let Some(text) = env("SENDQUOTA_INTAKE_SHARDS") else {
        return Ok(());
    };
    intake.shards = text.trim().parse().map_err(|_| {
        ConfigError::Invalid(format!(
            "SENDQUOTA_INTAKE_SHARDS \"{}\" is not a number of shards (1 to {})",
            one_line(&text),
            super::ranges::MAX_SHARDS
        ))
    })?;
    Ok(())
}

/// `SENDQUOTA_<SERVICE>_TLS_CA_FILE`, `..._TLS_CLIENT_CERT_FILE` and `..._TLS_CLIENT_KEY_FILE`
/// override the file's settings, as the URLs do (a container mounts its certificates and says
/// where in the environment).
fn tls_overrides(service: &str, files: &mut TlsFiles, env: &impl Fn(&str) -> Option<String>) {
    for (suffix, value) in [
        ("CA_FILE", &mut files.ca_file),
        ("CLIENT_CERT_FILE", &mut files.client_cert_file),
        ("CLIENT_KEY_FILE", &mut files.client_key_file),
    ] {
        if let Some(v) = env(&format!("SENDQUOTA_{service}_TLS_{suffix}")) {
            *value = v;
        }
    }
}

/// Applies `SENDQUOTA_LOG_FORMAT` and `SENDQUOTA_LOG_RECIPIENT_KEY`, and refuses a hashed
/// recipient without a key long enough to keep the hashes from being reversed.
pub(super) fn check_log(
    log: &mut LogSettings,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    if let Some(name) = env("SENDQUOTA_LOG_FORMAT") {
        log.format = LogFormat::parse(&name).ok_or_else(|| {
            ConfigError::Invalid(format!(
                "SENDQUOTA_LOG_FORMAT \"{}\" is not text or json",
                one_line(&name)
            ))
        })?;
    }
    log.recipient_key = RecipientKey(env("SENDQUOTA_LOG_RECIPIENT_KEY").unwrap_or_default());
    if log.recipient == RecipientLog::Hash && log.recipient_key.0.chars().count() < MIN_TOKEN_CHARS
    {
        return Err(ConfigError::Invalid(format!(
            "[log] recipient = \"hash\" needs SENDQUOTA_LOG_RECIPIENT_KEY, at least \
             {MIN_TOKEN_CHARS} characters"
        )));
    }
    Ok(())
}

/// Applies `SENDQUOTA_OTLP_ENDPOINT`, and refuses an endpoint that is not a plain `http://`
/// URL, naming where it came from. OpenTelemetry's `OTEL_EXPORTER_OTLP_ENDPOINT` is not read: a
/// platform that sets it for every pod would turn export on for the worker unasked, and an
/// `https://` one (which this exporter cannot reach) would stop every command from starting.
pub(super) fn check_telemetry(
    telemetry: &mut TelemetrySettings,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    let mut source = "[telemetry] otlp_endpoint";
    if let Some(endpoint) = env("SENDQUOTA_OTLP_ENDPOINT") {
        telemetry.otlp_endpoint = endpoint;
        source = "SENDQUOTA_OTLP_ENDPOINT";
    }
    let Some(url) = telemetry.traces_url() else {
        return Ok(());
    };
    let uri = url.parse::<axum::http::Uri>().ok();
    let http = uri
        .as_ref()
        .is_some_and(|u| u.scheme_str() == Some("http") && u.host().is_some_and(|h| !h.is_empty()));
    if !http {
        return Err(ConfigError::Invalid(format!(
            "{source} \"{}\" is not an http:// URL such as http://127.0.0.1:4318 (spans are \
             exported over plain HTTP only: run the collector beside the worker)",
            one_line(&redact_url(&telemetry.otlp_endpoint))
        )));
    }
    Ok(())
}
