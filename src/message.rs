//! The send request producers publish, decoded and validated at the edge.
//!
//! Everything after this module works with [`SendRequest`], whose fields are already known to be
//! well formed: ids are non-empty, short and free of control characters, the time zone exists,
//! the cost is positive. A body that is not such a request becomes an [`InvalidMessage`] that
//! names the reason, so the worker can route it to the invalid queue instead of failing.

use std::fmt;

use chrono_tz::Tz;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// Largest body the worker accepts by default; larger ones are invalid (a producer bug, or an
/// attempt to make the worker buffer arbitrary amounts of memory).
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 * 1024;
/// Longest message id, in characters: ids are keys in Redis and Postgres, and UUIDs, ULIDs and
/// most composite producer ids fit comfortably.
pub const MAX_ID_CHARS: usize = 128;
/// Longest recipient id, in characters (e-mail addresses can reach 254).
pub const MAX_RECIPIENT_CHARS: usize = 256;
/// Longest channel or category name, in characters.
pub const MAX_NAME_CHARS: usize = 64;
/// Longest id and channel in bytes: the id travels as the AMQP `message_id` property and the
/// channel as the dispatch routing key, both AMQP short strings of at most 255 bytes. A longer
/// one passes the character limits (64 emoji are 256 bytes), would take quota, and then could
/// never be published.
pub const MAX_AMQP_SHORT_BYTES: usize = 255;
/// Largest `cost` a request may ask for; keeps arithmetic in the scripts far from overflow.
pub const MAX_COST: u32 = 1_000_000;

/// Why a body is not a valid send request. The `Display` text is what lands in the invalid
/// queue's reason header, so it names the field and the rule it broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidMessage {
    /// The body is larger than the configured limit.
    #[error("body is {size} bytes, more than the limit of {limit}")]
    TooLarge {
        /// Size of the rejected body.
        size: usize,
        /// The configured maximum.
        limit: usize,
    },
    /// The body is not UTF-8 JSON of the expected shape (includes unknown fields).
    #[error("not a valid send request: {0}")]
    Malformed(String),
    /// A required field is absent.
    #[error("missing field `{0}`")]
    MissingField(&'static str),
    /// A string field is empty.
    #[error("field `{0}` is empty")]
    Empty(&'static str),
    /// A string field is longer than allowed.
    #[error("field `{field}` is {len} characters, more than the limit of {limit}")]
    TooLong {
        /// The offending field.
        field: &'static str,
        /// Its length in characters.
        len: usize,
        /// The limit for that field.
        limit: usize,
    },
    /// A string field that travels in an AMQP short string is longer than 255 bytes.
    #[error("field `{field}` is {bytes} bytes in UTF-8, more than AMQP's limit of {MAX_AMQP_SHORT_BYTES}")]
    TooManyBytes {
        /// The offending field.
        field: &'static str,
        /// Its length in bytes.
        bytes: usize,
    },
    /// A string field holds a control character.
    #[error("field `{0}` contains a control character")]
    ControlCharacter(&'static str),
    /// The time zone is not an IANA zone name.
    #[error("unknown time zone {0:?}")]
    UnknownTimeZone(String),
    /// The payload holds a NUL character, which the denial history (jsonb) cannot store.
    #[error("field `payload` contains a NUL character (\\u0000), which cannot be stored")]
    NulInPayload,
    /// The cost is zero or too large.
    #[error("field `cost` must be between 1 and {MAX_COST}, got {0}")]
    BadCost(i64),
}

/// A validated request to send one message to one recipient.
#[derive(Debug, Clone, PartialEq)]
pub struct SendRequest {
    /// The producer's unique id: the idempotency key for quotas, dispatch and denials.
    pub id: String,
    /// Who receives the message; quotas of scope `recipient` are kept per recipient.
    pub recipient: String,
    /// The sending channel (sms, push, email, ...); also the dispatch routing key.
    pub channel: String,
    /// The message category (marketing, transactional, ...); `default` when absent.
    pub category: String,
    /// The recipient's zone, if the producer named one; otherwise the configured default applies.
    pub timezone: Option<Tz>,
    /// Tokens the message takes from token buckets.
    pub cost: u32,
    /// Opaque content passed on to the senders; `None` when absent or `null`.
    pub payload: Option<Payload>,
}

/// A request's payload, kept as the JSON text the producer wrote. Dispatch publishes the
/// original body and a denial row stores this text, so the worker never builds a tree of it:
/// decoding checks it in one pass that allocates nothing. A tree would be built only to be
/// written out again, an allocation per value of every message; and the text passes through
/// exactly, floats and all.
#[derive(Debug, Clone)]
pub struct Payload(Box<RawValue>);

impl Payload {
    /// The payload of a request built in code (tools, tests); `None` for `null`, which is how
    /// an absent payload decodes.
    pub fn from_value(value: &serde_json::Value) -> Option<Payload> {
        if value.is_null() {
            return None;
        }
        serde_json::value::to_raw_value(value).ok().map(Payload)
    }

    /// The JSON text, as received.
    pub fn text(&self) -> &str {
        self.0.get()
    }

    /// The payload as a JSON value, for comparing and inspecting it.
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::from_str(self.0.get()).unwrap_or(serde_json::Value::Null)
    }
}

/// Equal when the JSON values are equal, whatever the spacing of their texts.
impl PartialEq for Payload {
    fn eq(&self, other: &Payload) -> bool {
        self.text() == other.text() || self.to_value() == other.to_value()
    }
}

/// The stored form of a request (see [`SendRequest::to_json`]). Serialising it cannot fail:
/// every field is a string, a number or an already valid JSON value.
#[derive(Serialize)]
struct Stored<'a> {
    id: &'a str,
    recipient: &'a str,
    channel: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    category: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timezone: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cost: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<&'a RawValue>,
}

/// The wire shape, deserialised before validation. Unknown fields are rejected so that a typo
/// such as `timezon` is reported instead of silently falling back to the default zone.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    id: Option<String>,
    recipient: Option<String>,
    channel: Option<String>,
    category: Option<String>,
    timezone: Option<String>,
    cost: Option<i64>,
    #[serde(default)]
    payload: Option<Box<RawValue>>,
}

impl SendRequest {
    /// Decodes and validates a body as it arrives from the broker.
    pub fn decode(body: &[u8], max_body_bytes: usize) -> Result<SendRequest, InvalidMessage> {
        if body.len() > max_body_bytes {
            return Err(InvalidMessage::TooLarge {
                size: body.len(),
                limit: max_body_bytes,
            });
        }
        let wire: Wire = serde_json::from_slice(body)
            .map_err(|e| InvalidMessage::Malformed(one_line(&e.to_string())))?;
        let id = short_string("id", required("id", wire.id, MAX_ID_CHARS)?)?;
        let recipient = required("recipient", wire.recipient, MAX_RECIPIENT_CHARS)?;
        let channel = short_string(
            "channel",
            required("channel", wire.channel, MAX_NAME_CHARS)?,
        )?;
        let category = match wire.category {
            Some(c) => checked("category", c, MAX_NAME_CHARS)?,
            None => "default".to_owned(),
        };
        let timezone = match wire.timezone {
            Some(name) => Some(
                name.parse::<Tz>()
                    .map_err(|_| InvalidMessage::UnknownTimeZone(name))?,
            ),
            None => None,
        };
        let cost = match wire.cost {
            None => 1,
            Some(c) if (1..=i64::from(MAX_COST)).contains(&c) => c as u32,
            Some(c) => return Err(InvalidMessage::BadCost(c)),
        };
        if let Some(payload) = &wire.payload {
            let Scan { nul } = serde_json::from_str(payload.get())
                .map_err(|e| InvalidMessage::Malformed(one_line(&format!("payload: {e}"))))?;
            if nul {
                return Err(InvalidMessage::NulInPayload);
            }
        }
        Ok(SendRequest {
            id,
            recipient,
            channel,
            category,
            timezone,
            cost,
            payload: wire.payload.map(Payload),
        })
    }

    /// The request as JSON, defaults left out: what a denial row keeps and a replay publishes.
    /// It decodes to an equal request and is never longer than a compact original, so a
    /// request accepted at the size limit can still be replayed.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self.stored()).unwrap_or(serde_json::Value::Null)
    }

    /// [`SendRequest::to_json`] as compact text, written straight from the request: the
    /// worker's denial path, which would otherwise build and free a JSON tree per denial.
    pub fn to_json_text(&self) -> String {
        serde_json::to_string(&self.stored()).unwrap_or_default()
    }

    fn stored(&self) -> Stored<'_> {
        Stored {
            id: &self.id,
            recipient: &self.recipient,
            channel: &self.channel,
            category: Some(self.category.as_str()).filter(|c| *c != "default"),
            timezone: self.timezone.map(|tz| tz.name()),
            cost: Some(self.cost).filter(|c| *c != 1),
            payload: self.payload.as_ref().map(|p| p.0.as_ref()),
        }
    }

    /// The zone the recipient's calendar days are counted in.
    pub fn zone(&self, default: Tz) -> Tz {
        self.timezone.unwrap_or(default)
    }
}

impl fmt::Display for SendRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "message {:?} to {:?} via {}",
            self.id, self.recipient, self.channel
        )
    }
}

/// `text` with control characters escaped, so an error that repeats an input value stays one
/// line (no forged log lines, one-line reasons in headers and on stderr).
pub fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// A payload walked the way serde_json builds a tree, without building one. The raw text is
/// only known to be JSON syntax; this pass refuses what a tree could not hold (a number out of
/// f64 range, which Postgres would store but the denial history could then not read back) and
/// notes a NUL in a string or key, which the history cannot store.
struct Scan {
    nul: bool,
}

/// What every value without text (a number, a boolean, null) scans to.
const NO_NUL: Scan = Scan { nul: false };

impl<'de> Deserialize<'de> for Scan {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Scan, D::Error> {
        deserializer.deserialize_any(ScanVisitor)
    }
}

struct ScanVisitor;

impl<'de> serde::de::Visitor<'de> for ScanVisitor {
    type Value = Scan;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Scan, E> {
        Ok(NO_NUL)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Scan, E> {
        Ok(NO_NUL)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Scan, E> {
        Ok(NO_NUL)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Scan, E> {
        Ok(NO_NUL)
    }

    fn visit_unit<E>(self) -> Result<Scan, E> {
        Ok(NO_NUL)
    }

    fn visit_str<E>(self, text: &str) -> Result<Scan, E> {
        Ok(Scan {
            nul: text.contains('\0'),
        })
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut items: A) -> Result<Scan, A::Error> {
        let mut nul = false;
        while let Some(item) = items.next_element::<Scan>()? {
            nul |= item.nul;
        }
        Ok(Scan { nul })
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut entries: A) -> Result<Scan, A::Error> {
        let mut nul = false;
        while let Some((key, value)) = entries.next_entry::<Scan, Scan>()? {
            nul |= key.nul || value.nul;
        }
        Ok(Scan { nul })
    }
}

fn required(
    field: &'static str,
    value: Option<String>,
    limit: usize,
) -> Result<String, InvalidMessage> {
    checked(
        field,
        value.ok_or(InvalidMessage::MissingField(field))?,
        limit,
    )
}

/// `value` when it fits in an AMQP short string.
fn short_string(field: &'static str, value: String) -> Result<String, InvalidMessage> {
    if value.len() > MAX_AMQP_SHORT_BYTES {
        return Err(InvalidMessage::TooManyBytes {
            field,
            bytes: value.len(),
        });
    }
    Ok(value)
}

fn checked(field: &'static str, value: String, limit: usize) -> Result<String, InvalidMessage> {
    if value.is_empty() {
        return Err(InvalidMessage::Empty(field));
    }
    let len = value.chars().count();
    if len > limit {
        return Err(InvalidMessage::TooLong { field, len, limit });
    }
    if value.chars().any(char::is_control) {
        return Err(InvalidMessage::ControlCharacter(field));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_or_channel_over_255_bytes_is_refused_though_within_its_characters() {
        let channel = "\u{1F600}".repeat(64);
        let body = format!(r#"{{"id":"e1","recipient":"r","channel":"{channel}"}}"#);
        assert_eq!(
            SendRequest::decode(body.as_bytes(), DEFAULT_MAX_BODY_BYTES),
            Err(InvalidMessage::TooManyBytes {
                field: "channel",
                bytes: 256
            })
        );
        let id = "\u{00E9}".repeat(128);
        let body = format!(r#"{{"id":"{id}","recipient":"r","channel":"sms"}}"#);
        assert_eq!(
            SendRequest::decode(body.as_bytes(), DEFAULT_MAX_BODY_BYTES).map_err(|e| e.to_string()),
            Err("field `id` is 256 bytes in UTF-8, more than AMQP's limit of 255".to_owned())
        );
        let fits = "\u{1F600}".repeat(63);
        let body = format!(r#"{{"id":"e1","recipient":"r","channel":"{fits}"}}"#);
        assert!(SendRequest::decode(body.as_bytes(), DEFAULT_MAX_BODY_BYTES).is_ok());
    }

    fn decode(body: &str) -> Result<SendRequest, InvalidMessage> {
        SendRequest::decode(body.as_bytes(), DEFAULT_MAX_BODY_BYTES)
    }

    #[test]
    fn a_full_request_decodes_with_every_field() {
        let m = decode(
            r#"{"id":"m1","recipient":"u","channel":"sms","category":"marketing",
                "timezone":"Asia/Shanghai","cost":3,"payload":{"a":1}}"#,
        )
        .unwrap();
        assert_eq!(m.id, "m1");
        assert_eq!(m.category, "marketing");
        assert_eq!(m.timezone, Some(chrono_tz::Asia::Shanghai));
        assert_eq!(m.cost, 3);
        assert_eq!(
            m.payload.map(|p| p.to_value()),
            Some(serde_json::json!({"a": 1}))
        );
    }

    #[test]
    fn optional_fields_take_their_defaults() {
        let m = decode(r#"{"id":"m1","recipient":"u","channel":"sms"}"#).unwrap();
        assert_eq!(m.category, "default");
        assert_eq!(m.timezone, None);
        assert_eq!(m.cost, 1);
        assert_eq!(m.payload, None);
    }

    #[test]
    fn each_broken_field_is_named_in_the_reason() {
        let cases = [
            (r#"{"recipient":"u","channel":"sms"}"#, "missing field `id`"),
            (
                r#"{"id":"","recipient":"u","channel":"sms"}"#,
                "field `id` is empty",
            ),
            (
                r#"{"id":"a\u0007b","recipient":"u","channel":"sms"}"#,
                "field `id` contains a control character",
            ),
            (
                r#"{"id":"m","recipient":"u","channel":"sms","cost":0}"#,
                "field `cost` must be between 1 and 1000000, got 0",
            ),
            (
                r#"{"id":"m","recipient":"u","channel":"sms","timezone":"Mars/Olympus"}"#,
                "unknown time zone \"Mars/Olympus\"",
            ),
        ];
        for (body, reason) in cases {
            assert_eq!(decode(body).unwrap_err().to_string(), reason, "{body}");
        }
    }

    #[test]
    fn unknown_fields_are_rejected_so_typos_cannot_change_the_zone() {
        let err = decode(r#"{"id":"m","recipient":"u","channel":"sms","timezon":"UTC"}"#);
        assert!(matches!(err, Err(InvalidMessage::Malformed(e)) if e.contains("timezon")));
    }

    #[test]
    fn a_nul_anywhere_in_the_payload_is_refused_and_an_escaped_backslash_is_not_one() {
        for body in [
            r#"{"id":"m","recipient":"u","channel":"sms","payload":"a\u0000b"}"#,
            r#"{"id":"m","recipient":"u","channel":"sms","payload":{"k\u0000":1}}"#,
            r#"{"id":"m","recipient":"u","channel":"sms","payload":[1,["\\\u0000"]]}"#,
            r#"{"id":"m","recipient":"u","channel":"sms","payload":"\u00000"}"#,
        ] {
            assert_eq!(decode(body), Err(InvalidMessage::NulInPayload), "{body}");
        }
        for body in [
            r#"{"id":"m","recipient":"u","channel":"sms","payload":"\\u0000"}"#,
            r#"{"id":"m","recipient":"u","channel":"sms","payload":"u0000 \u0001 \u1000"}"#,
        ] {
            assert!(decode(body).is_ok(), "{body}");
        }
    }

    #[test]
    fn a_payload_number_beyond_f64_is_malformed_as_when_the_payload_was_parsed_whole() {
        let err = decode(r#"{"id":"m","recipient":"u","channel":"sms","payload":{"e":1e400}}"#);
        assert!(
            matches!(&err, Err(InvalidMessage::Malformed(e)) if e.starts_with("payload: number out of range")),
            "{err:?}"
        );
        assert!(decode(
            r#"{"id":"m","recipient":"u","channel":"sms","payload":[1e300,18446744073709551616]}"#
        )
        .is_ok());
    }

    #[test]
    fn the_payload_text_is_kept_as_written() {
        let m = decode(
            r#"{"id":"m","recipient":"u","channel":"sms","payload": {"b": 1.50, "a" : [ ]}}"#,
        )
        .expect("valid");
        let payload = m.payload.as_ref().expect("a payload");
        assert_eq!(payload.text(), r#"{"b": 1.50, "a" : [ ]}"#);
        assert_eq!(
            m.to_json_text(),
            r#"{"id":"m","recipient":"u","channel":"sms","payload":{"b": 1.50, "a" : [ ]}}"#
        );
        assert_eq!(
            Payload::from_value(&serde_json::json!({"a": [], "b": 1.5})).as_ref(),
            Some(payload)
        );
        assert_eq!(Payload::from_value(&serde_json::Value::Null), None);
    }

    #[test]
    fn a_body_one_byte_over_the_limit_is_too_large() {
        let body = br#"{"id":"m","recipient":"u","channel":"sms"}"#;
        assert!(SendRequest::decode(body, body.len()).is_ok());
        assert_eq!(
            SendRequest::decode(body, body.len() - 1),
            Err(InvalidMessage::TooLarge {
                size: body.len(),
                limit: body.len() - 1
            })
        );
    }

    #[test]
    fn the_stored_form_leaves_defaults_out_and_its_text_is_the_same_json() {
        let full = decode(
            r#"{"id":"m1","recipient":"u","channel":"sms","category":"marketing",
                "timezone":"Asia/Shanghai","cost":3,"payload":{"a":[1,"x"]}}"#,
        )
        .expect("valid");
        let plain =
            decode(r#"{"id":"m2","recipient":"u","channel":"sms","category":"default","cost":1}"#)
                .expect("valid");
        assert_eq!(
            full.to_json(),
            serde_json::json!({"id": "m1", "recipient": "u", "channel": "sms",
                "category": "marketing", "timezone": "Asia/Shanghai", "cost": 3,
                "payload": {"a": [1, "x"]}})
        );
        assert_eq!(
            plain.to_json(),
            serde_json::json!({"id": "m2", "recipient": "u", "channel": "sms"})
        );
        for m in [full, plain] {
            let text: serde_json::Value =
                serde_json::from_str(&m.to_json_text()).expect("text is JSON");
            assert_eq!(text, m.to_json());
            assert_eq!(decode(&m.to_json_text()), Ok(m));
        }
    }
}
