//! The producer's contract: a JSON Schema (draft 2020-12) of the send request.
//!
//! Producers validate a request before they publish it, so a typo is caught in the producer's
//! own code and logs instead of in the invalid queue. The schema is built here from the limits
//! [`crate::request::message`] enforces (its constants, name grammar and refused characters), so the two
//! cannot drift apart; `sendquota schema` prints it. What a schema cannot say is stated in the
//! descriptions and in docs/producers.md: byte lengths (the AMQP short-string limit), format
//! characters outside the Basic Multilingual Plane, and the payload's number and nesting limits.

use serde_json::{json, Map, Value};

use crate::request::attributes::{MAX_ATTRIBUTES, MAX_KEY_CHARS, MAX_VALUE_CHARS};
use crate::request::message::{
    MAX_AMQP_SHORT_BYTES, MAX_COST, MAX_ID_CHARS, MAX_PAYLOAD_DEPTH, MAX_RECIPIENT_CHARS,
};
use crate::request::names::{format_ranges, MAX_NAME_CHARS, NAME_GRAMMAR};
use crate::request::priority::Priority;

/// The schema's `$id`: a name, not an address (the contract is documented in docs/producers.md),
/// versioned so a producer can tell a changed contract.
const SCHEMA_ID: &str = "urn:sendquota:send-request:1";

/// The JSON Schema of a send request, as `sendquota schema` prints it for a worker that
/// accepts bodies of up to `max_body_bytes`.
pub fn request_schema(max_body_bytes: usize) -> Value {
    let text = free_text_pattern();
    let properties: Map<String, Value> = [
        ("id", id(&text)),
        ("recipient", recipient(&text)),
        ("channel", channel()),
        ("category", category()),
        ("timezone", timezone()),
        ("cost", cost()),
        ("attributes", attributes(&text)),
        ("expires_at", expires_at()),
        ("priority", priority()),
        ("payload", payload()),
    ]
    .into_iter()
    .map(|(name, schema)| (name.to_owned(), schema))
    .collect();
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "sendquota send request",
        "description": format!(
            "One message to one recipient, published as the body (UTF-8 JSON, at most \
             {max_body_bytes} bytes) to the requests exchange. A request the worker refuses goes to the invalid queue \
             with the reason in its headers."
        ),
        "type": "object",
        "required": ["id", "recipient", "channel"],
        "additionalProperties": false,
        "properties": properties,
    })
}

/// The pattern of channels, categories and attribute keys: [`NAME_GRAMMAR`].
const NAME_PATTERN: &str = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$";

/// `id`, free text of `text_pattern`.
fn id(text_pattern: &str) -> Value {
    json!({
        "description": format!(
            "The producer's unique id of this message: the idempotency key of quotas, \
             dispatch and denials (send a retry with the same id). At most \
             {MAX_AMQP_SHORT_BYTES} bytes in UTF-8 (it travels as the AMQP message_id)."
        ),
        "type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS, "pattern": text_pattern,
    })
}

/// `recipient`, free text of `text_pattern`.
fn recipient(text_pattern: &str) -> Value {
    json!({
        "description": "Who receives the message; per-recipient quotas are kept per value.",
        "type": "string", "minLength": 1, "maxLength": MAX_RECIPIENT_CHARS,
        "pattern": text_pattern,
    })
}

/// `channel`, a name.
fn channel() -> Value {
    json!({
        "description": format!(
            "The sending channel, and the dispatch routing key: {NAME_GRAMMAR}."
        ),
        "type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS,
        "pattern": NAME_PATTERN,
    })
}

// The optional fields below take `null` as "absent", as the worker does.

/// `category`, a name.
fn category() -> Value {
    json!({
        "description": format!("The message's category; `default` when absent: {NAME_GRAMMAR}."),
        "type": ["string", "null"], "minLength": 1, "maxLength": MAX_NAME_CHARS,
        "pattern": NAME_PATTERN, "default": "default",
    })
}

/// `timezone`, one of the zones the worker knows.
fn timezone() -> Value {
    let zones: Vec<Value> = chrono_tz::TZ_VARIANTS
        .iter()
        .map(|z| Value::from(z.name()))
        .chain([Value::Null])
        .collect();
    json!({
        "description": "The recipient's IANA time zone, in which calendar days, quiet \
            hours and send windows are counted; the worker's default zone when absent.",
        "type": ["string", "null"], "enum": zones,
    })
}

/// `cost`, a whole number.
fn cost() -> Value {
    json!({
        "description": "Units the message takes from token buckets (other kinds count it \
            once), written as a whole number: `2`, not `2.0` or `2e0`.",
        "type": ["integer", "null"], "minimum": 1, "maximum": MAX_COST, "default": 1,
    })
}

/// `attributes`, names to free text of `text_pattern`.
fn attributes(text_pattern: &str) -> Value {
    json!({
        "description": "Short strings a rule can count by (`per_attributes`), such as a \
            campaign or workflow: keys are names, values short text.",
        "type": ["object", "null"], "maxProperties": MAX_ATTRIBUTES,
        "propertyNames": { "maxLength": MAX_KEY_CHARS, "pattern": NAME_PATTERN },
        "additionalProperties": {
            "type": "string", "minLength": 1, "maxLength": MAX_VALUE_CHARS,
            "pattern": text_pattern,
        },
    })
}

/// `expires_at`, an RFC 3339 instant.
fn expires_at() -> Value {
    json!({
        "description": "The instant past which the message must not be sent, in RFC 3339 \
            with an offset (`2026-05-01T09:00:00Z`, `2026-05-01T11:00:00+02:00`), from \
            1970-01-01T00:00:00Z up to (not including) 9000-01-01T00:00:00Z. A message \
            past it is recorded as a denial with reason `expired` and not sent.",
        "type": ["string", "null"], "format": "date-time", "pattern": EXPIRES_AT_PATTERN,
    })
}

/// `priority`, one of the priorities' names, the highest first.
fn priority() -> Value {
    json!({
        "description": "How urgent the message is: rules may exempt priorities \
            (`exempt`) or keep their last slots for the higher ones (`reserve`).",
        "type": ["string", "null"],
        "enum": Priority::ALL.iter().rev().map(|p| Some(p.as_str())).chain([None]).collect::<Vec<_>>(),
        "default": Priority::default().as_str(),
    })
}

/// `payload`, any JSON value the denial history can store.
fn payload() -> Value {
    json!({
        "description": format!(
            "Opaque content passed to the senders unchanged. Any JSON value that \
             Postgres's jsonb can store: no NUL character, arrays and objects nested at \
             most {MAX_PAYLOAD_DEPTH} deep, numbers within Postgres numeric's range."
        ),
    })
}

/// The shape of an RFC 3339 instant with an offset, in the years the worker takes and without
/// the leap second (`:60`) it refuses (the `date-time` format is only an annotation to most
/// validators). It cannot say which days a
/// month has, nor that an offset moves the first instants of 1970 into 1969.
const EXPIRES_AT_PATTERN: &str = r"^(19[7-9][0-9]|[2-8][0-9]{3})-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt ]([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$";

/// The pattern of ids and recipients: no control character and no format character or
/// separator the worker refuses, as an ECMA-262 character class of the Basic Multilingual
/// Plane (the characters beyond it cannot be named without the `u` flag, which JSON Schema
/// does not promise).
fn free_text_pattern() -> String {
    let mut class = String::from(r"^[^\u0000-\u001F\u007F-\u009F");
    for (lo, hi) in format_ranges().filter(|&(_, hi)| hi <= 0xFFFF) {
        class.push_str(&format!(r"\u{lo:04X}"));
        if hi != lo {
            class.push_str(&format!(r"-\u{hi:04X}"));
        }
    }
    class.push_str("]*$");
    class
}
