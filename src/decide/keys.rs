//! Every Redis name sendquota uses, in one place: rule keys and their ids keys, dispatch marks,
//! in-flight claims, and the deny cache's pub/sub channel.
//!
//! A key looks like `<ns>:{r:<recipient>}:<rule>:<kind>`. The part in braces is the Redis
//! Cluster hash tag, so every key of one scope lands on one slot and a scope's rules can be
//! checked in one script call. Ids from messages are percent-encoded so that no byte of theirs
//! can close the hash tag early, open a second one, or add a `:` segment: two different
//! recipients always get different keys, and a recipient's keys always share its tag.
//!
//! A rule counting per attributes (`per_attributes`) keeps one state per tuple of values:
//! with the recipient scope its key is the recipient's key with one more segment, the tuple
//! (`<ns>:{r:<recipient>}:<rule>:<kind>:campaign=<value>`), so it is decided in the
//! recipient's script call; with the global scope the tuple is its hash tag
//! (`<ns>:{a:campaign=<value>}:<rule>:<kind>`), so the states of different values spread over
//! the cluster. The tuple is `key=value` pairs joined by `,` in the rule's order; keys are
//! names (no `=`, `,`, `:` or braces) and values are percent-encoded, so two different tuples
//! never give one segment.

use std::fmt::Write;

use crate::rules::policy::ScopeValue;

/// Bytes that may appear in a key segment as they are; everything else is `%XX`.
fn is_plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'@' | b'+')
}

/// Percent-encodes an id for use inside a key segment. The output never contains `{`, `}`,
/// `:` or whitespace, and different inputs give different outputs.
pub fn encode(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    encode_into(&mut out, id);
    out
}

/// [`encode`], appended to `out`. Keys are built for every decision, so they are assembled in
/// one buffer instead of through `format!`.
fn encode_into(out: &mut String, id: &str) {
    if id.bytes().all(is_plain) {
        out.push_str(id);
        return;
    }
    for &b in id.as_bytes() {
        if is_plain(b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

/// The hash tag (braces included) shared by all keys of one scope value.
pub fn scope_tag(scope: &ScopeValue<'_>) -> String {
    let (prefix, id) = match scope {
        ScopeValue::Recipient(r) => ("{r:", *r),
        ScopeValue::Channel(c) => ("{c:", *c),
        ScopeValue::Category(c) => ("{k:", *c),
        ScopeValue::Global => return "{g}".to_owned(),
    };
    let mut tag = String::with_capacity(prefix.len() + id.len() + 1);
    tag.push_str(prefix);
    encode_into(&mut tag, id);
    tag.push('}');
    tag
}

/// The tuple segment of a rule counting per attributes: `key=value` pairs (values encoded)
/// joined by `,`, appended to `out`.
fn attribute_segment_into<'a>(
    out: &mut String,
    values: impl IntoIterator<Item = (&'a str, &'a str)>,
) {
    for (i, (key, value)) in values.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // A key is a name (names::NAME_GRAMMAR): plain already, encoding leaves it as it is.
        encode_into(out, key);
        out.push('=');
        encode_into(out, value);
    }
}

/// The hash tag of a global rule counting per attributes: its tuple of values (see the
/// module's comment), so each tuple's state has a slot of its own.
pub fn attributes_tag<'a>(values: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut tag = String::from("{a:");
    attribute_segment_into(&mut tag, values);
    tag.push('}');
    tag
}

/// The key of a rule counting per attributes inside another scope's tag (the recipient's):
/// [`rule_key`] with the tuple of values as one more segment. The segment always holds a `=`,
/// so it is never taken for the `ids` of a rule's key of the same name counting without.
pub fn rule_key_per<'a>(
    namespace: &str,
    tag: &str,
    rule: &str,
    kind: &str,
    values: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> String {
    let mut key = rule_key(namespace, tag, rule, kind);
    key.push(':');
    attribute_segment_into(&mut key, values);
    key
}

/// `parts` joined by `:`.
fn join(parts: &[&str]) -> String {
    let mut out = String::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push(':');
        }
        out.push_str(part);
    }
    out
}

/// The key that holds one rule's state for one scope value. The kind is part of the name so a
/// rule whose kind changes starts afresh instead of reading another kind's data structure, while
/// a rule whose limits change keeps its counters.
pub fn rule_key(namespace: &str, tag: &str, rule: &str, kind: &str) -> String {
    join(&[namespace, tag, rule, kind])
}

/// The companion key of a rule's key: the message ids it admitted (see lua/decide.lua).
pub fn ids_key(rule_key: &str) -> String {
    join(&[rule_key, "ids"])
}

/// The in-flight claim on one message id (a string: the holding delivery's token, expiring
/// with its lease; see [`crate::decide::claim`]), under the recipient's hash tag so the decision
/// script reads it with the quota. A key of its own, not a field of a per-recipient hash: Redis
/// expires it on its own clock, so no script reads the time or rewrites an expiry. The id's
/// segment begins `id=`, which no limiter kind's name does, so a claim's key never equals a
/// rule's key (`<ns>:<tag>:<rule>:<kind>`, a rule named `claim`).
pub fn claim_key(namespace: &str, tag: &str, message_id: &str) -> String {
    let mut key = join(&[namespace, tag, "claim", "id="]);
    key.push_str(message_id);
    key
}

/// The sorted set of a recipient's dispatched message ids (score: when the mark expires, in
/// epoch ms; see [`crate::decide::dedup`]). It carries the recipient's hash tag, so the decision script
/// of the recipient scope can read it in the same call; with three segments after the
/// namespace it cannot collide with a rule's key, which has four.
pub fn sent_key(namespace: &str, tag: &str) -> String {
    join(&[namespace, tag, "sent"])
}

/// [`sent_key`] of `recipient`, for callers that do not hold the recipient's tag already.
pub fn recipient_sent_key(namespace: &str, recipient: &str) -> String {
    sent_key(namespace, &scope_tag(&ScopeValue::Recipient(recipient)))
}

/// The Redis pub/sub channel on which quota-freeing events of `namespace` are announced to
/// every worker's deny cache (see [`crate::decide::deny_cache`]).
pub fn deny_cache_channel(namespace: &str) -> String {
    join(&[namespace, "deny-cache"])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slot Redis Cluster hashes a key to is decided by the first `{...}` with content.
    fn cluster_tag(key: &str) -> &str {
        if let Some(open) = key.find('{') {
            if let Some(len) = key[open + 1..].find('}') {
                if len > 0 {
                    return &key[open + 1..open + 1 + len];
                }
            }
        }
        key
    }

    #[test]
    fn braces_and_colons_in_a_recipient_cannot_change_the_key_shape() {
        let tag = scope_tag(&ScopeValue::Recipient("a}{b:c"));
        let key = rule_key("ns", &tag, "daily", "calendar_quota");
        assert_eq!(key, "ns:{r:a%7D%7Bb%3Ac}:daily:calendar_quota");
        assert_eq!(cluster_tag(&key), "r:a%7D%7Bb%3Ac");
        assert_eq!(key.matches(':').count(), 4);
    }

    #[test]
    fn recipients_that_differ_only_in_escapes_get_different_keys() {
        let a = scope_tag(&ScopeValue::Recipient("a:b"));
        let b = scope_tag(&ScopeValue::Recipient("a%3Ab"));
        assert_ne!(a, b);
    }

    #[test]
    fn unicode_and_control_bytes_are_encoded() {
        assert_eq!(encode("Łí\u{1}"), "%C5%81%C3%AD%01");
        assert_eq!(encode("plain-id_1.x@y+z"), "plain-id_1.x@y+z");
    }

    #[test]
    fn every_key_of_a_scope_is_its_parts_joined_by_colons() {
        let tag = scope_tag(&ScopeValue::Channel("sms"));
        assert_eq!(tag, "{c:sms}");
        assert_eq!(scope_tag(&ScopeValue::Category("a b")), "{k:a%20b}");
        assert_eq!(scope_tag(&ScopeValue::Global), "{g}");
        let key = rule_key("ns", &tag, "rate", "gcra");
        assert_eq!(key, "ns:{c:sms}:rate:gcra");
        assert_eq!(ids_key(&key), "ns:{c:sms}:rate:gcra:ids");
    }

    /// Every string a producer could send as an attribute value that could confuse a key:
    /// separators of the segment and of the key, braces, escapes, look-alikes of other tuples.
    const TRICKY: [&str; 14] = [
        "a",
        "a,b=c",
        "a=b",
        "b",
        "a%2Cb%3Dc",
        "a:b",
        "{a}",
        "}",
        "{",
        "a b",
        "%",
        "%25",
        ",",
        "=",
    ];

    #[test]
    fn attribute_tuples_never_share_a_key_or_a_tag() {
        let mut keys = std::collections::HashSet::new();
        let mut tags = std::collections::HashSet::new();
        let tag = scope_tag(&ScopeValue::Recipient("r"));
        let mut tuples = 0;
        for one in TRICKY {
            for two in TRICKY {
                let tuple = [("campaign", one), ("step", two)];
                tuples += 1;
                let key = rule_key_per("ns", &tag, "cap", "fixed_window", tuple);
                assert_eq!(cluster_tag(&key), "r:r", "{key} keeps the recipient's slot");
                assert_eq!(key.matches(':').count(), 5, "{key}: one segment more");
                assert!(keys.insert(key.clone()), "{key} twice");
                assert!(keys.insert(ids_key(&key)), "{key}:ids twice");
                let global = attributes_tag(tuple);
                assert_eq!(global.matches('{').count(), 1, "{global}");
                assert_eq!(global.matches('}').count(), 1, "{global}");
                assert_eq!(global.matches(':').count(), 1, "{global}");
                assert!(tags.insert(global.clone()), "{global} twice");
                let key = rule_key("ns", &global, "cap", "fixed_window");
                assert_eq!(cluster_tag(&key), &global[1..global.len() - 1]);
            }
            // A tuple of one value never meets a tuple of two.
            let single = [("campaign", one)];
            assert!(keys.insert(rule_key_per("ns", &tag, "cap", "fixed_window", single)));
            assert!(tags.insert(attributes_tag(single)));
        }
        assert_eq!(tags.len(), tuples + TRICKY.len());
        // Nor the rule's key and ids without attributes, nor another key of the recipient.
        let plain = rule_key("ns", &tag, "cap", "fixed_window");
        for other in [
            plain.clone(),
            ids_key(&plain),
            sent_key("ns", &tag),
            claim_key("ns", &tag, "gcra"),
        ] {
            assert!(!keys.contains(&other), "{other}");
        }
        assert_eq!(
            rule_key_per("ns", &tag, "cap", "fixed_window", [("campaign", "a,b=c")]),
            "ns:{r:r}:cap:fixed_window:campaign=a%2Cb%3Dc"
        );
        assert_eq!(
            attributes_tag([("campaign", "spring"), ("step", "{x}")]),
            "{a:campaign=spring,step=%7Bx%7D}"
        );
    }

    #[test]
    fn a_recipients_marks_share_its_hash_tag() {
        assert_eq!(recipient_sent_key("ns", "r1"), "ns:{r:r1}:sent");
    }
}
