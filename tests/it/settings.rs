//! Every numeric setting outside the range the worker can run with is refused at start, by
//! every command: exit 2 and one line naming the setting and its range, never a panic later.

use std::process::Command;
use std::time::Duration;

use sendquota::config::{Settings, NUMERIC_SETTINGS};

use crate::support;
use support::process::{run_for, Run};
use support::TempFile;

/// `args` run with `config` and a database nobody listens on: a command that got as far as
/// connecting would fail with exit 1, not 2.
fn run(config: &TempFile, args: &[&str]) -> Run {
    let mut cmd: Command = support::process::sendquota();
    cmd.env("SENDQUOTA_LOG", "off")
        .env(
            "SENDQUOTA_DATABASE_URL",
            "postgres://postgres@127.0.0.1:1/sendquota",
        )
        .arg("--config")
        .arg(config.path())
        .args(args);
    run_for(cmd, None, Duration::from_secs(20))
}

/// Values no setting takes: negative, beyond every integer type, beyond TOML's integers, not
/// whole; and those just outside the setting's own range.
fn out_of_range(min: u64, max: u64) -> Vec<String> {
    let mut values: Vec<String> = ["-1", "18446744073709551615", "99999999999999999999", "1e30"]
        .map(str::to_owned)
        .into();
    if min > 0 {
        values.push("0".to_owned());
        values.push((min - 1).to_string());
    }
    values.push((max + 1).to_string());
    values.dedup();
    values
}

#[test]
fn every_numeric_setting_out_of_range_exits_2_with_one_line_naming_it_from_every_command() {
    for setting in &NUMERIC_SETTINGS {
        let (section, key, min, max) = (setting.section, setting.key, setting.min, setting.max);
        for value in out_of_range(min, max) {
            let config = TempFile::new(&format!("[{section}]\n{key} = {value}\n"));
            let expected = format!(
                "sendquota: [{section}] {key} must be between {min} and {max} (got {value})\n"
            );
            for args in [&["config", "check"][..], &["denials"][..]] {
                let run = run(&config, args);
                let what = format!("{key} = {value}, {args:?}");
                assert!(!run.stderr.contains("panicked"), "{what}: {run:?}");
                assert_eq!(
                    (run.code, run.stdout.as_str(), run.stderr.as_str()),
                    (Some(2), "", expected.as_str()),
                    "{what}"
                );
            }
        }
    }
}

#[test]
fn a_first_retry_delay_longer_than_the_largest_is_refused() {
    let config = TempFile::new("[worker]\nretry_initial_ms = 500\nretry_max_ms = 100\n");
    let run = run(&config, &["config", "check"]);
    assert_eq!(
        (run.code, run.stderr.as_str()),
        (
            Some(2),
            "sendquota: [worker] retry_initial_ms (500) must be at most retry_max_ms (100)\n"
        )
    );
}

#[test]
fn every_numeric_setting_at_the_ends_of_its_range_is_accepted() {
    let (mut low, mut high) = (String::new(), String::new());
    for section in ["redis", "amqp", "database", "worker"] {
        for text in [&mut low, &mut high] {
            text.push_str(&format!("[{section}]\n"));
        }
        for s in NUMERIC_SETTINGS.iter().filter(|s| s.section == section) {
            low.push_str(&format!("{} = {}\n", s.key, s.min));
            high.push_str(&format!("{} = {}\n", s.key, s.max));
        }
    }
    for text in [low, high] {
        let config = TempFile::new(&text);
        let run = run(&config, &["config", "check"]);
        assert_eq!((run.code, run.stderr.as_str()), (Some(0), ""), "{text}");
    }
}

/// The list the walk above takes is the configuration's own; this keeps it complete: every
/// whole number among the effective settings has a range in it.
#[test]
fn every_numeric_setting_has_a_range() {
    let defaults = Settings::load(None, |_| None).expect("the defaults load");
    let effective: toml::Table = toml::from_str(&defaults.effective_toml()).expect("TOML");
    let mut numeric = Vec::new();
    for (section, table) in &effective {
        let Some(table) = table.as_table() else {
            continue;
        };
        for (key, value) in table {
            if value.is_integer() {
                numeric.push(format!("{section}.{key}"));
            }
        }
    }
    let ranged: Vec<String> = NUMERIC_SETTINGS
        .iter()
        .map(|s| format!("{}.{}", s.section, s.key))
        .collect();
    numeric.sort();
    let mut sorted = ranged.clone();
    sorted.sort();
    assert_eq!(numeric, sorted);
}
