//! The send request producers publish, decoded and validated at the edge.
//!
//! Everything after this module works with [`SendRequest`], whose fields are already known to be
//! well formed: ids are non-empty, short and free of control characters, the time zone exists,
//! the cost is positive. A body that is not such a request becomes an [`InvalidMessage`] that
//! names the reason, so the worker can route it to the invalid queue instead of failing.
//! Decoding and each field's checks are in `decode`; what Postgres can store of a payload, in
//! `payload`.

mod decode;
mod payload;

use std::fmt;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::request::attributes::{AttributeError, Attributes};
use crate::request::names::{describe, NameFault, NAME_GRAMMAR};
use crate::request::priority::Priority;
pub(crate) use decode::decode_attributes;
pub use payload::{
    number_fault, MAX_DIGITS_AFTER_POINT, MAX_DIGITS_BEFORE_POINT, MAX_PAYLOAD_DEPTH,
};

/// Largest body the worker accepts by default; larger ones are invalid (a producer bug, or an
/// attempt to make the worker buffer arbitrary amounts of memory).
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 * 1024;
/// Longest message id, in characters: ids are keys in Redis and Postgres, and UUIDs, ULIDs and
/// most composite producer ids fit comfortably.
pub const MAX_ID_CHARS: usize = 128;
/// Longest recipient id, in characters (e-mail addresses can reach 254).
pub const MAX_RECIPIENT_CHARS: usize = 256;
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
    /// A string field holds an invisible formatting or bidirectional control character, or a
    /// line or paragraph separator (see [`format_character`](crate::request::names::format_character)): ids and names are shown in logs
    /// and tables, where such a character hides, reorders or breaks what is around it.
    #[error("field `{field}` contains U+{:04X}, {}", u32::from(*.character), describe(*.character))]
    FormatCharacter {
        /// The offending field.
        field: &'static str,
        /// The first such character.
        character: char,
    },
    /// A channel or category is not a name of the grammar [`NAME_GRAMMAR`].
    #[error("field `{field}` {fault}: {NAME_GRAMMAR}")]
    NotAName {
        /// The offending field.
        field: &'static str,
        /// What breaks the grammar.
        fault: NameFault,
    },
    /// A field holds a JSON value of the wrong type.
    #[error("field `{field}` must be {expected}, got {got}")]
    WrongType {
        /// The offending field.
        field: &'static str,
        /// What it must be.
        expected: &'static str,
        /// The JSON type it is.
        got: &'static str,
    },
    /// A string escapes half of a UTF-16 surrogate pair alone (`"\ud800"`), which no Unicode
    /// text can hold.
    #[error("{}lone surrogate {escape} in a string is not valid Unicode", field.map(|f| format!("field `{f}`: ")).unwrap_or_default())]
    LoneSurrogate {
        /// The field it is in, when known (a key of the body is in none).
        field: Option<&'static str>,
        /// The escape as written, such as `\ud800`.
        escape: String,
    },
    /// A payload number that Postgres's numeric type, and so the denial history's jsonb copy,
    /// cannot hold (see [`number_fault`]).
    #[error(
        "field `payload` holds the number {number}, which the denial history cannot store: \
         {fault}"
    )]
    UnstorableNumber {
        /// The number as written (its start, when long).
        number: String,
        /// Which of Postgres's limits it passes.
        fault: &'static str,
    },
    /// The time zone is not an IANA zone name; holds the name as [`echo`] repeats it.
    #[error("unknown time zone {0}")]
    UnknownTimeZone(String),
    /// The payload nests arrays and objects deeper than [`MAX_PAYLOAD_DEPTH`], which the
    /// denial history's jsonb copy cannot be parsed from.
    #[error("field `payload` nests arrays and objects deeper than {MAX_PAYLOAD_DEPTH} levels")]
    TooDeep,
    /// The payload holds a NUL character, which the denial history (jsonb) cannot store.
    #[error("field `payload` contains a NUL character (\\u0000), which cannot be stored")]
    NulInPayload,
    /// The cost is not a whole number from 1 to [`MAX_COST`]; holds what it is instead (see
    /// [`echo_json`](decode::echo_json)).
    #[error("field `cost` must be a whole number from 1 to {MAX_COST}, got {0}")]
    BadCost(String),
    /// The priority is not one of [`Priority::ALL`]'s names; holds the name as [`echo`]
    /// repeats it.
    #[error("field `priority` must be {names}, got {0}", names = Priority::names())]
    BadPriority(String),
    /// The attributes break a limit of [`crate::request::attributes`]; names the key at fault.
    #[error("field `attributes`: {0}")]
    Attribute(AttributeError),
    /// `expires_at` is not an RFC 3339 instant with an offset, or is not one of the instants
    /// the worker holds ([`crate::base::clock::in_range`]: outside the range, or a leap second).
    #[error("field `expires_at` {fault}, got {got}")]
    BadExpiresAt {
        /// The text as [`echo`] repeats it.
        got: String,
        /// Which rule it breaks ([`ExpiresAt::NOT_RFC3339`], [`ExpiresAt::OUT_OF_RANGE`] or
        /// [`ExpiresAt::LEAP_SECOND`]).
        fault: &'static str,
    },
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
    /// What the producer says the message belongs to (campaign, workflow...): rules can count
    /// per attribute value (`per_attributes`); empty when absent.
    pub attributes: Attributes,
    /// The instant past which the message must not be sent (a one-time code, a reminder of an
    /// event that has begun); `None` when absent or `null`. See [`crate::decide::deadline`].
    pub expires_at: Option<ExpiresAt>,
    /// How urgent it is: rules may exempt priorities or keep slots for the higher ones;
    /// `normal` when absent.
    pub priority: Priority,
}

/// A request's `expires_at`: the instant, and the text the producer wrote, kept so the stored
/// form of a request is never longer than its original (a replay of a request accepted at the
/// size limit still fits) and reads back equal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiresAt {
    at: DateTime<Utc>,
    text: String,
}

impl ExpiresAt {
    /// Why a text that is no RFC 3339 instant is refused.
    pub const NOT_RFC3339: &'static str =
        "must be an RFC 3339 instant with an offset, such as 2026-05-01T09:00:00Z";
    /// Why an instant outside the supported ones is refused: deadlines are compared with the
    /// worker's clock and stored, which hold only those.
    pub const OUT_OF_RANGE: &'static str = "must lie from 1970-01-01T00:00:00Z up to (not \
        including) 9000-01-01T00:00:00Z";
    /// Why a leap second (`23:59:60Z`) is refused, as every instant from outside is
    /// ([`crate::base::clock::in_range`]): the worker's clock, Unix time, has no such second.
    pub const LEAP_SECOND: &'static str = "must not be a leap second (a 60th second): the \
        worker's clock has none";

    /// Parses `text` as the worker takes it: RFC 3339 with an offset, one of the instants the
    /// worker holds; otherwise which rule it breaks.
    pub fn parse(text: &str) -> Result<ExpiresAt, &'static str> {
        let at = DateTime::parse_from_rfc3339(text)
            .map_err(|_| ExpiresAt::NOT_RFC3339)?
            .with_timezone(&Utc);
        crate::base::clock::in_range(at).map_err(|e| match e {
            crate::base::clock::OutOfRange::LeapSecond { .. } => ExpiresAt::LEAP_SECOND,
            crate::base::clock::OutOfRange::Range { .. } => ExpiresAt::OUT_OF_RANGE,
        })?;
        Ok(ExpiresAt {
            at,
            text: text.to_owned(),
        })
    }

    /// The instant.
    pub fn at(&self) -> DateTime<Utc> {
        self.at
    }

    /// The text as the producer wrote it.
    pub fn text(&self) -> &str {
        &self.text
    }
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
    #[serde(skip_serializing_if = "Option::is_none")]
    attributes: Option<&'a Attributes>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expires_at: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    priority: Option<Priority>,
}

impl SendRequest {
    /// The request as JSON, defaults left out: what a denial row keeps and a replay publishes.
    /// It decodes to an equal request and is never longer than a compact original, so a
    /// request accepted at the size limit can still be replayed. As a tree, for tools and
    /// tests: a payload number beyond f64 makes it `null`, where [`SendRequest::to_json_text`]
    /// keeps it exactly.
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
            attributes: Some(&self.attributes).filter(|a| !a.is_empty()),
            expires_at: self.expires_at.as_ref().map(ExpiresAt::text),
            priority: Some(self.priority).filter(|p| *p != Priority::default()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::names::{format_character, name_fault};

    #[test]
    fn an_id_over_255_bytes_is_refused_though_within_its_characters() {
        let id = "\u{00E9}".repeat(128);
        let body = format!(r#"{{"id":"{id}","recipient":"r","channel":"sms"}}"#);
        assert_eq!(
            SendRequest::decode(body.as_bytes(), DEFAULT_MAX_BODY_BYTES).map_err(|e| e.to_string()),
            Err("field `id` is 256 bytes in UTF-8, more than AMQP's limit of 255".to_owned())
        );
        let fits = "\u{00E9}".repeat(127);
        let body = format!(r#"{{"id":"{fits}","recipient":"r","channel":"sms"}}"#);
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
                "field `cost` must be a whole number from 1 to 1000000, got 0",
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
    fn channels_and_categories_are_dot_separated_words_and_nothing_else() {
        for good in [
            "sms",
            "push.ios",
            "e-mail",
            "a_b.C-9.x",
            "0",
            "sms.eu.transactional",
        ] {
            assert_eq!(name_fault(good), None, "{good}");
            let body =
                format!(r#"{{"id":"m","recipient":"u","channel":"{good}","category":"{good}"}}"#);
            assert!(decode(&body).is_ok(), "{body}");
        }
        for (bad, fault) in [
            (" ", NameFault::Character(' ')),
            ("sms.#", NameFault::Character('#')),
            ("sms.*", NameFault::Character('*')),
            ("#", NameFault::Character('#')),
            ("sms ios", NameFault::Character(' ')),
            ("sms/ios", NameFault::Character('/')),
            ("sms:ios", NameFault::Character(':')),
            ("sm\u{e9}", NameFault::Character('\u{e9}')),
            (".sms", NameFault::EmptyWord),
            ("sms.", NameFault::EmptyWord),
            ("sms..ios", NameFault::EmptyWord),
            (".", NameFault::EmptyWord),
        ] {
            assert_eq!(name_fault(bad), Some(fault), "{bad:?}");
            let body = serde_json::json!({"id": "m", "recipient": "u", "channel": bad}).to_string();
            assert_eq!(
                decode(&body),
                Err(InvalidMessage::NotAName {
                    field: "channel",
                    fault
                }),
                "{bad:?}"
            );
            let body = serde_json::json!({"id": "m", "recipient": "u", "channel": "sms",
                "category": bad})
            .to_string();
            assert_eq!(
                decode(&body),
                Err(InvalidMessage::NotAName {
                    field: "category",
                    fault
                }),
                "{bad:?}"
            );
        }
        assert_eq!(
            decode(r#"{"id":"m","recipient":"u","channel":"sms.#"}"#).map_err(|e| e.to_string()),
            Err(
                "field `channel` holds `#` (U+0023): a name is one or more words of letters, \
                 digits, `_` and `-` joined by single dots, such as `sms` or `push.ios`"
                    .to_owned()
            )
        );
    }

    #[test]
    fn format_characters_and_line_separators_are_refused_in_every_text_field() {
        for c in [
            '\u{ad}',
            '\u{61c}',
            '\u{200b}',
            '\u{200d}',
            '\u{200e}',
            '\u{2028}',
            '\u{2029}',
            '\u{202a}',
            '\u{202e}',
            '\u{2060}',
            '\u{2066}',
            '\u{2069}',
            '\u{feff}',
            '\u{fff9}',
            '\u{1343f}',
            '\u{e0001}',
            '\u{e007f}',
        ] {
            assert!(format_character(c), "U+{:04X}", u32::from(c));
            for field in ["id", "recipient", "channel", "category"] {
                let mut body = serde_json::json!({"id": "m", "recipient": "u", "channel": "sms"});
                body[field] = format!("a{c}b").into();
                assert_eq!(
                    decode(&body.to_string()),
                    Err(InvalidMessage::FormatCharacter {
                        field,
                        character: c
                    }),
                    "U+{:04X} in {field}",
                    u32::from(c)
                );
            }
        }
    }

    #[test]
    fn visible_characters_and_other_spaces_are_not_format_characters() {
        for c in [
            'a',
            ' ',
            '\u{a0}',
            '\u{2027}',
            '\u{202f}',
            '\u{2065}',
            '\u{fffc}',
            '\u{1f600}',
        ] {
            assert!(!format_character(c), "U+{:04X}", u32::from(c));
        }
    }

    #[test]
    fn a_refused_character_s_reason_says_what_it_is() {
        let reason = |recipient: &str| {
            decode(
                &serde_json::json!({"id": "m", "recipient": recipient, "channel": "sms"})
                    .to_string(),
            )
            .unwrap_err()
            .to_string()
        };
        assert_eq!(
            reason("evil\u{202e}gpj.exe"),
            "field `recipient` contains U+202E, an invisible formatting or bidirectional control \
             character (Unicode category Cf)"
        );
        assert_eq!(
            reason("a\u{2028}b"),
            "field `recipient` contains U+2028, a line or paragraph separator"
        );
    }

    #[test]
    fn payload_numbers_postgres_numeric_holds_are_stored() {
        for stored in [
            "0",
            "-0",
            "1e400",
            "1e131071",
            "-9.9e131071",
            "10e131070",
            "0.001e131074",
            "0.5e131072",
            "1e-16383",
            "1.5e-16382",
            "123.456e-16380",
            "0e-16383",
            "0e131072",
            "0e1073741822",
            "-0.0E+1073741822",
            "1E+131071",
            "123456789012345678901234567890",
        ] {
            assert_eq!(number_fault(stored), None, "{stored}");
        }
    }

    #[test]
    fn payload_numbers_are_refused_exactly_where_postgres_numeric_ends() {
        let before =
            Some("Postgres's numeric keeps at most 131072 digits before the decimal point");
        let after = Some(
            "Postgres's numeric keeps at most 16383 digits after the decimal point, zeros \
             written at the end included",
        );
        let exponent = Some("Postgres's numeric takes an exponent below 1073741823 in size");
        for (refused, fault) in [
            ("1e131072", before),
            ("-1e+131072", before),
            ("10e131071", before),
            ("0.001e131075", before),
            ("1e-16384", after),
            ("1.0e-16383", after),
            ("1.50e-16382", after),
            ("0e-16384", after),
            ("-0e-16384", after),
            ("1e-20000", after),
            ("0e1073741823", exponent),
            ("0e-1073741823", exponent),
            ("1e99999999999999999999", exponent),
        ] {
            assert_eq!(number_fault(refused), fault, "{refused}");
        }
    }

    #[test]
    fn an_unstorable_payload_number_is_named_and_others_pass_through_as_written() {
        let body = r#"{"id":"m","recipient":"u","channel":"sms","payload":{"a":["x",1e-20000]}}"#;
        assert_eq!(
            decode(body).map_err(|e| e.to_string()),
            Err(
                "field `payload` holds the number 1e-20000, which the denial history cannot \
                 store: Postgres's numeric keeps at most 16383 digits after the decimal point, \
                 zeros written at the end included"
                    .to_owned()
            )
        );
        let long = format!("1{}e-16383", ".".to_owned() + &"0".repeat(50));
        let body = format!(r#"{{"id":"m","recipient":"u","channel":"sms","payload":{long}}}"#);
        assert!(
            matches!(decode(&body), Err(InvalidMessage::UnstorableNumber { number, .. })
                if number == format!("{}...", &long[..40])),
        );
        let inside =
            r#"{"id":"m","recipient":"u","channel":"sms","payload":{"1e-20000":"1e-20000"}}"#;
        assert!(decode(inside).is_ok(), "numbers in strings are text");
        let beyond_f64 =
            decode(r#"{"id":"m","recipient":"u","channel":"sms","payload":{"e":1e400}}"#)
                .expect("a number beyond f64 passes through");
        assert_eq!(
            beyond_f64.payload.map(|p| p.text().to_owned()),
            Some(r#"{"e":1e400}"#.to_owned())
        );
    }

    #[test]
    fn reasons_name_the_field_and_the_real_problem_instead_of_the_parser_s_words() {
        let cases = [
            (r#"{"id":"\ud800","recipient":"u","channel":"sms"}"#,
                r"field `id`: lone surrogate \ud800 in a string is not valid Unicode"),
            (r#"{"id":"m","recipient":"a\uDC00b","channel":"sms"}"#,
                r"field `recipient`: lone surrogate \uDC00 in a string is not valid Unicode"),
            (r#"{"id":"m","recipient":"u","channel":"sms","payload":["\ud83d\ude00","\ud83d x"]}"#,
                r"field `payload`: lone surrogate \ud83d in a string is not valid Unicode"),
            (r#"{"\ud800":1,"id":"m","recipient":"u","channel":"sms"}"#,
                r"lone surrogate \ud800 in a string is not valid Unicode"),
            (r#"{"id":5,"recipient":"u","channel":"sms"}"#,
                "field `id` must be a string, got a number"),
            (r#"{"id":"m","recipient":["u"],"channel":"sms"}"#,
                "field `recipient` must be a string, got an array"),
            (r#"{"id":"m","recipient":"u","channel":"sms","timezone":true}"#,
                "field `timezone` must be a string, got a boolean"),
            (r#"{"id":"m","recipient":"u","channel":"sms","cost":1.5}"#,
                "field `cost` must be a whole number from 1 to 1000000, got 1.5"),
            (r#"{"id":"m","recipient":"u","channel":"sms","cost":"3"}"#,
                "field `cost` must be a whole number from 1 to 1000000, got \"3\""),
            (r#"{"id":"m","recipient":"u","channel":"sms","cost":1e400}"#,
                "field `cost` must be a whole number from 1 to 1000000, got 1e400"),
            (r#"[1]"#, "not a valid send request: invalid length 1, expected a JSON object at line 1 column 3"),
            (r#" ["m","u","sms",null,null,null] "#, "not a valid send request: expected a JSON object, got an array"),
            (r#""m""#, "not a valid send request: invalid type: string \"m\", expected a JSON object at line 1 column 3"),
        ];
        for (body, reason) in cases {
            assert_eq!(decode(body).unwrap_err().to_string(), reason, "{body}");
        }
        let deep = format!(
            r#"{{"id":"m","recipient":"u","channel":"sms","payload":{}1{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        assert_eq!(decode(&deep), Err(InvalidMessage::TooDeep));
        let deepest = format!(
            r#"{{"id":"m","recipient":"u","channel":"sms","payload":{}{{}}{}}}"#,
            "[".repeat(126),
            "]".repeat(126)
        );
        assert!(decode(&deepest).is_ok());
        let one_more = format!(
            r#"{{"id":"m","recipient":"u","channel":"sms","payload":{}{{}}{}}}"#,
            "[".repeat(127),
            "]".repeat(127)
        );
        assert_eq!(decode(&one_more), Err(InvalidMessage::TooDeep));
        assert_eq!(
            decode(
                r#"{"id":"m","recipient":"u","channel":"sms","payload":"\ud83d\ude00 \\ud800"}"#
            )
            .map(|m| m.payload.map(|p| p.to_value())),
            Ok(Some(serde_json::json!("\u{1f600} \\ud800"))),
            "a pair, and an escaped backslash before ud800, are not lone surrogates"
        );
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
    fn attributes_decode_sorted_are_stored_and_decode_back_equal() {
        for (attributes, stored) in [
            (r#"{}"#, None),
            (r#"null"#, None),
            (
                r#"{"step":"2","campaign":"spring sale \u00e9"}"#,
                Some(serde_json::json!({"campaign": "spring sale \u{e9}", "step": "2"})),
            ),
            (
                r#"{"a.b-c_d":"{x}:%y,z=w"}"#,
                Some(serde_json::json!({"a.b-c_d": "{x}:%y,z=w"})),
            ),
        ] {
            let body = format!(
                r#"{{"id":"m","recipient":"u","channel":"sms","attributes":{attributes}}}"#
            );
            let m = decode(&body).unwrap_or_else(|e| panic!("{body}: {e}"));
            assert_eq!(m.to_json().get("attributes").cloned(), stored, "{body}");
            assert_eq!(decode(&m.to_json_text()), Ok(m.clone()), "{body}");
            assert!(m.to_json_text().len() <= body.len(), "{body}");
        }
        let m =
            decode(r#"{"id":"m","recipient":"u","channel":"sms","attributes":{"b":"2","a":"1"}}"#)
                .expect("valid");
        assert_eq!(m.attributes.get("a"), Some("1"));
        assert_eq!(m.attributes.get("b"), Some("2"));
        assert_eq!(
            m.attributes,
            Attributes::from_pairs([("a", "1"), ("b", "2")]).expect("valid")
        );
        assert_eq!(
            decode(r#"{"id":"m","recipient":"u","channel":"sms","attributes":{"a":1}}"#)
                .map_err(|e| e.to_string()),
            Err(
                r#"field `attributes`: value of key "a" must be a string, got a number"#.to_owned()
            )
        );
    }

    /// A request whose `expires_at` is the JSON text `expires_at`, decoded.
    fn with(expires_at: &str) -> Result<SendRequest, InvalidMessage> {
        decode(&format!(
            r#"{{"id":"m","recipient":"u","channel":"sms","expires_at":{expires_at}}}"#
        ))
    }

    #[test]
    fn expires_at_is_an_rfc3339_instant_with_an_offset_in_the_supported_range() {
        for (text, instant) in [
            ("2026-05-01T09:00:00Z", "2026-05-01T09:00:00Z"),
            ("2026-05-01T11:00:00+02:00", "2026-05-01T09:00:00Z"),
            ("2026-05-01t09:00:00.5z", "2026-05-01T09:00:00.500Z"),
            ("2026-05-01 09:00:00-00:00", "2026-05-01T09:00:00Z"),
            ("1970-01-01T00:00:00Z", "1970-01-01T00:00:00Z"),
            ("8999-12-31T23:59:59.999Z", "8999-12-31T23:59:59.999Z"),
        ] {
            let m = with(&format!("{text:?}")).unwrap_or_else(|e| panic!("{text}: {e}"));
            let expires_at = m.expires_at.clone().expect("an expires_at");
            assert_eq!(
                expires_at.at(),
                instant.parse::<DateTime<Utc>>().unwrap(),
                "{text}"
            );
            assert_eq!(
                m.to_json()["expires_at"],
                serde_json::Value::from(text),
                "kept as written"
            );
            assert_eq!(decode(&m.to_json_text()), Ok(m.clone()), "{text}");
        }
        assert_eq!(with("null").map(|m| m.expires_at), Ok(None));
    }

    #[test]
    fn an_expires_at_that_is_no_rfc3339_instant_or_out_of_range_is_refused() {
        let not_rfc3339 =
            "must be an RFC 3339 instant with an offset, such as 2026-05-01T09:00:00Z";
        let out_of_range =
            "must lie from 1970-01-01T00:00:00Z up to (not including) 9000-01-01T00:00:00Z";
        for (json, reason) in [
            (
                r#""2026-05-01T09:00:00""#,
                format!("{not_rfc3339}, got \"2026-05-01T09:00:00\""),
            ),
            (
                r#""2026-05-01""#,
                format!("{not_rfc3339}, got \"2026-05-01\""),
            ),
            (
                r#""2026-02-30T09:00:00Z""#,
                format!("{not_rfc3339}, got \"2026-02-30T09:00:00Z\""),
            ),
            (r#""tomorrow""#, format!("{not_rfc3339}, got \"tomorrow\"")),
            (r#""""#, format!("{not_rfc3339}, got \"\"")),
            (
                r#""1969-12-31T23:59:59Z""#,
                format!("{out_of_range}, got \"1969-12-31T23:59:59Z\""),
            ),
            (
                r#""1970-01-01T00:30:00+01:00""#,
                format!("{out_of_range}, got \"1970-01-01T00:30:00+01:00\""),
            ),
            (
                r#""9000-01-01T00:00:00Z""#,
                format!("{out_of_range}, got \"9000-01-01T00:00:00Z\""),
            ),
            // Escaped once, as every field's value is (the reason read `"a\\nb"`: escaped twice).
            (r#""a\nb""#, format!("{not_rfc3339}, got \"a\\nb\"")),
            ("1777626000", "must be a string, got a number".to_owned()),
        ] {
            assert_eq!(
                with(json).map_err(|e| e.to_string()),
                Err(format!("field `expires_at` {reason}")),
                "{json}"
            );
        }
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
