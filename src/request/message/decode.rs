//! Decoding a body into a [`SendRequest`]: the wire shape, then each field read and checked on
//! its own, so that a refused body's reason names the field at fault and what is wrong with it.

use chrono_tz::Tz;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::payload::{lone_surrogate, payload_fault};
use super::{one_line, ExpiresAt, InvalidMessage, Payload, SendRequest};
use super::{MAX_AMQP_SHORT_BYTES, MAX_COST, MAX_ID_CHARS, MAX_RECIPIENT_CHARS};
use crate::request::attributes::{self, Attributes};
use crate::request::names::{cut, echo, format_character, json_type, name_fault, MAX_NAME_CHARS};
use crate::request::priority::Priority;

/// The wire shape: each field's JSON text, borrowed from the body, read by [`SendRequest::decode`]
/// one field at a time so that a reason names the field at fault. Unknown fields are rejected
/// so that a typo such as `timezon` is reported instead of silently falling back to the
/// default zone.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a JSON object",
    bound(deserialize = "'de: 'a")
)]
struct Wire<'a> {
    id: Option<&'a RawValue>,
    recipient: Option<&'a RawValue>,
    channel: Option<&'a RawValue>,
    category: Option<&'a RawValue>,
    timezone: Option<&'a RawValue>,
    cost: Option<&'a RawValue>,
    #[serde(default)]
    payload: Option<Box<RawValue>>,
    // Defaulted as `payload` is, so that an array of the first fields still gets past serde
    // (which would take the fields in order from it) to the object check's clearer reason.
    #[serde(default)]
    attributes: Option<&'a RawValue>,
    // Defaulted as `attributes` is, for the same reason.
    #[serde(default)]
    expires_at: Option<&'a RawValue>,
    #[serde(default)]
    priority: Option<&'a RawValue>,
}

impl<'a> Wire<'a> {
    /// The body's fields, once it is known to be within the size limit and a JSON object.
    fn read(body: &'a [u8], max_body_bytes: usize) -> Result<Wire<'a>, InvalidMessage> {
        if body.len() > max_body_bytes {
            return Err(InvalidMessage::TooLarge {
                size: body.len(),
                limit: max_body_bytes,
            });
        }
        let wire: Wire = serde_json::from_slice(body).map_err(|e| malformed(None, body, &e))?;
        // serde would also take the fields in order from an array.
        if body.trim_ascii_start().first() != Some(&b'{') {
            let got = json_type(std::str::from_utf8(body.trim_ascii_start()).unwrap_or_default());
            return Err(InvalidMessage::Malformed(format!(
                "expected a JSON object, got {got}"
            )));
        }
        Ok(wire)
    }
}

impl SendRequest {
    /// Decodes and validates a body as it arrives from the broker. The fields are read in
    /// the order below: a body with several faults is refused for the first.
    pub fn decode(body: &[u8], max_body_bytes: usize) -> Result<SendRequest, InvalidMessage> {
        let wire = Wire::read(body, max_body_bytes)?;
        let id = short_string("id", required("id", wire.id, MAX_ID_CHARS)?)?;
        let recipient = required("recipient", wire.recipient, MAX_RECIPIENT_CHARS)?;
        let channel = name(
            "channel",
            required("channel", wire.channel, MAX_NAME_CHARS)?,
        )?;
        let category = category(wire.category)?;
        let timezone = timezone(wire.timezone)?;
        let cost = cost(wire.cost)?;
        let payload = payload(wire.payload)?;
        let attributes = match wire.attributes {
            Some(raw) => decode_attributes(raw.get())?,
            None => Attributes::default(),
        };
        let expires_at = expires_at(wire.expires_at)?;
        let priority = priority(wire.priority)?;
        Ok(SendRequest {
            id,
            recipient,
            channel,
            category,
            timezone,
            cost,
            payload,
            attributes,
            expires_at,
            priority,
        })
    }
}

/// The `category`: a name of the grammar; `default` when absent.
fn category(raw: Option<&RawValue>) -> Result<String, InvalidMessage> {
    match optional("category", raw, MAX_NAME_CHARS)? {
        Some(c) => name("category", c),
        None => Ok("default".to_owned()),
    }
}

/// The `timezone`: an IANA zone name, when present.
fn timezone(raw: Option<&RawValue>) -> Result<Option<Tz>, InvalidMessage> {
    match text("timezone", raw)? {
        Some(name) => name
            .parse::<Tz>()
            .map(Some)
            .map_err(|_| InvalidMessage::UnknownTimeZone(echo(&name))),
        None => Ok(None),
    }
}

/// The `cost`: a whole number from 1 to [`MAX_COST`]; 1 when absent.
fn cost(raw: Option<&RawValue>) -> Result<u32, InvalidMessage> {
    match raw.map(RawValue::get) {
        None => Ok(1),
        Some(raw) => raw
            .parse::<u32>()
            .ok()
            .filter(|c| (1..=MAX_COST).contains(c))
            .ok_or_else(|| InvalidMessage::BadCost(echo_json(raw))),
    }
}

/// The `payload`, kept as written once the denial history is known to be able to store it.
fn payload(raw: Option<Box<RawValue>>) -> Result<Option<Payload>, InvalidMessage> {
    if let Some(payload) = &raw {
        if let Some(fault) = payload_fault(payload.get()) {
            return Err(fault);
        }
    }
    Ok(raw.map(Payload))
}

/// The `expires_at`: an instant the worker holds, kept as written, when present.
fn expires_at(raw: Option<&RawValue>) -> Result<Option<ExpiresAt>, InvalidMessage> {
    match text("expires_at", raw)? {
        Some(at) => ExpiresAt::parse(&at)
            .map(Some)
            .map_err(|fault| InvalidMessage::BadExpiresAt {
                got: echo(&at),
                fault,
            }),
        None => Ok(None),
    }
}

/// The `priority`: one of [`Priority::ALL`]'s names; `normal` when absent.
fn priority(raw: Option<&RawValue>) -> Result<Priority, InvalidMessage> {
    match text("priority", raw)? {
        Some(name) => {
            Priority::parse(&name).ok_or_else(|| InvalidMessage::BadPriority(echo(&name)))
        }
        None => Ok(Priority::default()),
    }
}

/// A required string field, checked as [`optional`] does.
fn required(
    field: &'static str,
    raw: Option<&RawValue>,
    limit: usize,
) -> Result<String, InvalidMessage> {
    optional(field, raw, limit)?.ok_or(InvalidMessage::MissingField(field))
}

/// A string field when present: not empty, at most `limit` characters, and free of control
/// and format characters.
fn optional(
    field: &'static str,
    raw: Option<&RawValue>,
    limit: usize,
) -> Result<Option<String>, InvalidMessage> {
    let Some(value) = text(field, raw)? else {
        return Ok(None);
    };
    if value.is_empty() {
        return Err(InvalidMessage::Empty(field));
    }
    // The usual field is ASCII: one pass over its bytes decides all three checks (no format
    // character is ASCII).
    if value.is_ascii() {
        if value.len() > limit {
            let len = value.len();
            return Err(InvalidMessage::TooLong { field, len, limit });
        }
        if value.bytes().any(|b| b.is_ascii_control()) {
            return Err(InvalidMessage::ControlCharacter(field));
        }
        return Ok(Some(value));
    }
    let len = value.chars().count();
    if len > limit {
        return Err(InvalidMessage::TooLong { field, len, limit });
    }
    if value.chars().any(char::is_control) {
        return Err(InvalidMessage::ControlCharacter(field));
    }
    if let Some(character) = value.chars().find(|&c| format_character(c)) {
        return Err(InvalidMessage::FormatCharacter { field, character });
    }
    Ok(Some(value))
}

/// A field's JSON text read as a string, with a reason naming the field when it is not one.
fn text(field: &'static str, raw: Option<&RawValue>) -> Result<Option<String>, InvalidMessage> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let json = raw.get();
    if !json.starts_with('"') {
        return Err(InvalidMessage::WrongType {
            field,
            expected: "a string",
            got: json_type(json),
        });
    }
    // The text was checked as JSON with the whole body: a string without escapes is the text
    // between its quotes (a raw control character is not valid JSON), read without parsing it
    // again.
    if let Some(plain) = json
        .strip_prefix('"')
        .and_then(|j| j.strip_suffix('"'))
        .filter(|j| !j.contains('\\'))
    {
        return Ok(Some(plain.to_owned()));
    }
    serde_json::from_str(json)
        .map(Some)
        .map_err(|e| malformed(Some(field), json.as_bytes(), &e))
}

/// A channel or category: `value` when it is a name of [`NAME_GRAMMAR`].
fn name(field: &'static str, value: String) -> Result<String, InvalidMessage> {
    match name_fault(&value) {
        Some(fault) => Err(InvalidMessage::NotAName { field, fault }),
        None => Ok(value),
    }
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

/// A JSON value where a number was due, as a reason repeats it: a number as written (its
/// characters need no escape; cut as [`echo`] cuts), a string as [`echo`] repeats its text,
/// anything else by its type.
fn echo_json(json: &str) -> String {
    match json_type(json) {
        "a number" => cut(json),
        "a string" => serde_json::from_str::<String>(json)
            .map(|text| echo(&text))
            .unwrap_or_else(|_| "a string".to_owned()),
        other => other.to_owned(),
    }
}

/// Decodes a request's `attributes` (its JSON text) and checks every limit.
pub(crate) fn decode_attributes(json: &str) -> Result<Attributes, InvalidMessage> {
    let refused = InvalidMessage::Attribute;
    if !json.starts_with('{') {
        return Err(refused(attributes::AttributeError::NotAnObject(json_type(
            json,
        ))));
    }
    let attributes::Entries(raw) = serde_json::from_str(json)
        .map_err(|e| malformed(Some("attributes"), json.as_bytes(), &e))?;
    if raw.len() > attributes::MAX_ATTRIBUTES {
        return Err(refused(attributes::AttributeError::TooMany(raw.len())));
    }
    let mut entries = Vec::with_capacity(raw.len());
    for (key, value) in raw {
        attributes::check_key(&key).map_err(refused)?;
        let text = value.get();
        if !text.starts_with('"') {
            return Err(refused(attributes::AttributeError::Value {
                key: echo(&key),
                fault: attributes::ValueFault::NotAString(json_type(text)),
            }));
        }
        let value: String = serde_json::from_str(text)
            .map_err(|e| malformed(Some("attributes"), text.as_bytes(), &e))?;
        attributes::check_value(&key, &value).map_err(refused)?;
        entries.push((key, value));
    }
    Attributes::sorted(entries).map_err(refused)
}

/// The reason for a body (or a field's `json`) serde_json refused. Its messages are kept where
/// they say what is wrong; a lone surrogate, of which serde_json says "unexpected end of hex
/// escape", is named here, and an unknown field's name is repeated as every value is.
fn malformed(field: Option<&'static str>, json: &[u8], e: &serde_json::Error) -> InvalidMessage {
    let message = e.to_string();
    // serde names an unknown field between backticks, as it came: repeated as [`echo`] does.
    if let Some((name, rest)) = message.strip_prefix("unknown field `").and_then(|rest| {
        rest.rfind("`, expected")
            .map(|end| (&rest[..end], &rest[end + 1..]))
    }) {
        return InvalidMessage::Malformed(format!(
            "unknown field {}{}",
            echo(name),
            one_line(rest)
        ));
    }
    if message.starts_with("unexpected end of hex escape")
        || message.starts_with("lone leading surrogate in hex escape")
    {
        if let Some(escape) = std::str::from_utf8(json).ok().and_then(lone_surrogate) {
            return InvalidMessage::LoneSurrogate { field, escape };
        }
    }
    InvalidMessage::Malformed(one_line(&message))
}
