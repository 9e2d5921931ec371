//! One broken configuration per file in tests/fixtures/config, each refused at start-up with an
//! exact, one-line message naming the rule and the parameter at fault. And the policies in
//! tests/fixtures/policies (`support::fixtures`): each is read by some test.

use std::path::Path;

use sendquota::config::Settings;

fn refusal(fixture: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/config")
        .join(format!("{fixture}.toml"));
    match Settings::load(Some(&path), |_| None) {
        Ok(_) => panic!("{fixture} was accepted"),
        Err(e) => e.to_string().replace(&path.display().to_string(), "FILE"),
    }
}

macro_rules! refused {
    ($($fixture:ident => $message:expr,)*) => {$(
        #[test]
        fn $fixture() {
            assert_eq!(refusal(stringify!($fixture)), $message);
        }
    )*};
}

refused! {
    unknown_kind => "rule \"r\": unknown kind \"bogus_window\" (known kinds: calendar_quota, \
        fixed_window, sliding_window, sliding_log, leaky_bucket, token_bucket, gcra, zset_window, \
        quiet_hours, send_window)",
    zero_window => "rule \"r\": window must be longer than zero, got \"0s\"",
    negative_window => "rule \"r\": window \"-5m\" is not a duration (a whole number followed by \
        ms, s, m, h or d)",
    cost_above_capacity => "rule \"r\": cost (6) is larger than capacity (5): no send could ever pass",
    sliding_log_shorter_window_larger_limit => "rule \"r\": the policy over 1m allows 100, not \
        fewer than the policy over the longer 1h (50): a shorter window must have a smaller limit",
    duplicate_rule_name => "duplicate rule name \"r\"",
    unknown_time_zone => "default_timezone: unknown time zone \"Mars/Olympus_Mons\"",
    quiet_hours_unparsable => "rule \"r\": start \"22h\" is not a time of day as HH:MM",
    quiet_hours_day_twice => "rule \"r\": days lists \"fri\" twice",
    exempt_unknown_priority => "config file FILE: line 7: unknown priority \"urgent\" (expected \
        critical, high, normal or low)",
    exempt_counts_without_exempt => "rule \"r\": exempt_counts needs exempt (the priorities it is about)",
    reserve_more_than_the_smallest_limit => "rule \"r\": reserve slots must be from 1 to the rule's \
        smallest limit (2), got 3",
    reserve_on_a_window_kind => "rule \"r\": reserve needs a kind with limits to keep slots of \
        (calendar_quota), not fixed_window",
    reserve_until_unparsable => "rule \"r\": reserve until \"6pm\" is not a time of day as HH:MM",
    send_window_overlapping => "rule \"r\": windows.mon entries \"09:00-12:00\" and \"11:30-17:30\" \
        overlap",
    send_window_past_midnight => "rule \"r\": windows.fri entry \"20:00-02:00\" does not end after it \
        starts: a window ends on its own day, by 24:00 (run past midnight with \"22:00-24:00\" and \
        \"00:00-02:00\" on the next day)",
    misspelt_parameter => "rule \"r\": unknown parameter `per_dya` for kind calendar_quota",
    sub_window_not_dividing_window => "rule \"r\": window (1m) is not a multiple of sub_window (7s)",
    unknown_on_deny => "config file FILE: line 4: unknown on_deny \"ignore\" (expected drop, delay, \
        shadow or digest)",
    digest_by_on_a_drop_rule => "rule \"r\": digest_by groups held messages, so it needs \
        on_deny = \"digest\" (this rule's on_deny is \"drop\")",
    digest_by_no_request_can_carry => "rule \"r\": digest_by entry \"campaign id\" holds U+0020, \
        so no request can carry it: a name is one or more words of letters, digits, `_` and `-` \
        joined by single dots, such as `sms` or `push.ios`",
    unknown_on_unavailable => "config file FILE: line 4: unknown on_unavailable \"open\" (expected \
        wait or allow)",
    per_day_above_per_window => "rule \"r\": per_day (4) is larger than per_window (3)",
    too_many_threads => "[worker] threads must be between 0 and 1024 (got 100000)",
    zero_max_connections => "[database] max_connections must be between 1 and 1000 (got 0)",
    token_bucket_waiting_past_the_supported_range => "rule \"r\": a send of cost 2000 could wait \
        732000 days for its tokens (capacity 2000 refilled 1 per 366d), more than the 365000 days \
        any rule may make a message wait",
    match_channel_no_request_can_carry => "rule \"r\": match channels entry \"sms.*\" holds `*` \
        (U+002A), so no request can carry it: a name is one or more words of letters, digits, `_` \
        and `-` joined by single dots, such as `sms` or `push.ios`",
    per_attributes_key_no_request_can_carry => "rule \"r\": per_attributes entry \"campaign id\" \
        holds U+0020, so no request can carry it: a name is one or more words of letters, digits, \
        `_` and `-` joined by single dots, such as `sms` or `push.ios`",
    per_attributes_with_a_channel_scope => "rule \"r\": per_attributes needs scope \"recipient\" \
        or \"global\" (per attribute value, for each recipient or for everyone)",
    per_attributes_twice => "rule \"r\": per_attributes lists \"campaign\" twice",
    max_delay_on_a_drop_rule => "rule \"r\": max_delay limits how long a rule holds a message, \
        so it needs on_deny = \"delay\" (this rule's on_deny is \"drop\")",
    max_delay_not_a_duration => "rule \"r\": max_delay \"2 hours\" is not a duration (a whole \
        number followed by ms, s, m, h or d)",
    max_delay_a_number => "rule \"r\": max_delay must be a duration such as \"2h\", got integer",
    match_category_no_request_can_carry => "rule \"r\": match categories entry \"two words\" holds \
        U+0020, so no request can carry it: a name is one or more words of letters, digits, `_` \
        and `-` joined by single dots, such as `sms` or `push.ios`",
}

#[test]
fn every_fixture_has_a_test() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/config");
    let source = include_str!("config_fixtures.rs");
    for entry in std::fs::read_dir(dir).expect("fixtures") {
        let name = entry.expect("entry").path();
        let stem = name.file_stem().and_then(|s| s.to_str()).expect("name");
        assert!(
            source.contains(&format!("    {stem} => ")),
            "no test for fixture {stem}"
        );
    }
}

#[test]
fn every_policy_fixture_is_read_by_a_test() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut read = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(root.join("tests/it")).expect("the tests") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "rs") {
            let source = std::fs::read_to_string(&path).expect("a test's source");
            for after in source.split("policy!(").skip(1) {
                let name = after
                    .trim_start()
                    .strip_prefix('"')
                    .and_then(|a| a.split_once('"'));
                read.extend(name.map(|(name, _)| name.to_owned()));
            }
        }
    }
    for entry in std::fs::read_dir(root.join("tests/fixtures/policies")).expect("fixtures") {
        let name = entry.expect("entry").path();
        let stem = name.file_stem().and_then(|s| s.to_str()).expect("name");
        assert!(read.contains(stem), "no test reads policy fixture {stem}");
    }
}
