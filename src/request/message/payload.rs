//! What the denial history's jsonb copy of a request can store, checked on the payload's text in
//! one pass that allocates nothing unless it finds a fault: no NUL, no lone surrogate, no
//! nesting beyond Postgres's stack, no number beyond Postgres's numeric. The same pass finds
//! the lone surrogate serde_json lets through in any field's text, to name it in a reason.

use super::InvalidMessage;
use crate::request::names::cut;

/// The first lone surrogate escape in the strings of `json` (known to be JSON syntax), as
/// written.
pub(super) fn lone_surrogate(json: &str) -> Option<String> {
    match scan(json) {
        Some(Fault::LoneSurrogate(at)) => json.get(at..at + 6).map(str::to_owned),
        _ => None,
    }
}

/// Why the denial history could not store a payload (`json`, known to be JSON syntax): a NUL
/// character, a lone surrogate, or a number beyond Postgres's numeric. One pass over the text,
/// allocating nothing unless it finds one: the payload is never built into a tree.
pub(super) fn payload_fault(json: &str) -> Option<InvalidMessage> {
    Some(match scan(json)? {
        Fault::Nul => InvalidMessage::NulInPayload,
        Fault::LoneSurrogate(at) => InvalidMessage::LoneSurrogate {
            field: Some("payload"),
            escape: json.get(at..at + 6).unwrap_or_default().to_owned(),
        },
        Fault::TooDeep => InvalidMessage::TooDeep,
        Fault::Number(at, end, fault) => InvalidMessage::UnstorableNumber {
            number: cut(json.get(at..end).unwrap_or_default()),
            fault,
        },
    })
}

/// What [`scan`] found, with its byte offset in the text.
enum Fault {
    /// A `\u0000` escape in a string or key.
    Nul,
    /// A `\uD800`..`\uDFFF` escape that is not half of a pair.
    LoneSurrogate(usize),
    /// A number (from, to) that Postgres's numeric cannot hold, and why.
    Number(usize, usize, &'static str),
    /// Arrays and objects nested deeper than [`MAX_PAYLOAD_DEPTH`].
    TooDeep,
}

/// Deepest nesting of arrays and objects in a payload. Postgres parses jsonb recursively and
/// refuses a deep one with "stack depth limit exceeded" (SQLSTATE 54001: 30,000 levels fail
/// at the default `max_stack_depth`), a failure that looks like the service's and would be
/// retried for ever; 127 is what serde_json allows inside the request object.
pub const MAX_PAYLOAD_DEPTH: usize = 127;

/// The first fault in `json` (known to be JSON syntax: serde_json checked it, escapes and
/// numbers included, but lets a lone surrogate through in text it does not decode).
fn scan(json: &str) -> Option<Fault> {
    let bytes = json.as_bytes();
    let mut i = 0;
    let mut depth = 0;
    while let Some(&b) = bytes.get(i) {
        i = match b {
            b'[' | b'{' if depth == MAX_PAYLOAD_DEPTH => return Some(Fault::TooDeep),
            b'[' | b'{' => {
                depth += 1;
                i + 1
            }
            b']' | b'}' => {
                depth = depth.saturating_sub(1);
                i + 1
            }
            b'"' => match scan_string(bytes, i + 1) {
                Ok(end) => end,
                Err(fault) => return Some(fault),
            },
            b'-' | b'0'..=b'9' => {
                let end = i + bytes[i..]
                    .iter()
                    .take_while(|b| matches!(b, b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'))
                    .count();
                if let Some(fault) = json.get(i..end).and_then(number_fault) {
                    return Some(Fault::Number(i, end, fault));
                }
                end
            }
            _ => i + 1,
        };
    }
    None
}

/// Walks a string from just after its opening quote to just after its closing one.
fn scan_string(bytes: &[u8], mut i: usize) -> Result<usize, Fault> {
    while let Some(&b) = bytes.get(i) {
        match (b, bytes.get(i + 1)) {
            (b'"', _) => return Ok(i + 1),
            (b'\\', Some(b'u')) => match hex_unit(bytes, i) {
                Some(0) => return Err(Fault::Nul),
                Some(0xD800..=0xDBFF)
                    if matches!(hex_unit(bytes, i + 6), Some(0xDC00..=0xDFFF)) =>
                {
                    i += 12
                }
                Some(0xD800..=0xDFFF) => return Err(Fault::LoneSurrogate(i)),
                _ => i += 6,
            },
            (b'\\', _) => i += 2,
            _ => i += 1,
        }
    }
    Ok(i)
}

/// The UTF-16 unit of the `\uXXXX` escape at `at`, if one is there.
fn hex_unit(bytes: &[u8], at: usize) -> Option<u32> {
    let escape = bytes.get(at..at + 6)?;
    if !escape.starts_with(b"\\u") {
        return None;
    }
    u32::from_str_radix(std::str::from_utf8(&escape[2..]).ok()?, 16).ok()
}

/// Most digits Postgres's numeric keeps before the decimal point: the first significant
/// digit's weight in base 10,000 is an int16 (32767), so 4 × 32768.
pub const MAX_DIGITS_BEFORE_POINT: i64 = 131_072;
/// Most digits Postgres's numeric keeps after the decimal point (its display scale, 14 bits),
/// counting the zeros written at the end.
pub const MAX_DIGITS_AFTER_POINT: i64 = 16_383;
/// Postgres 15 refuses an exponent of this size or more before anything else (`INT_MAX / 2`),
/// even for zero.
const MAX_EXPONENT: u64 = 1_073_741_823;

/// Why Postgres's numeric, which jsonb stores numbers in, cannot hold the JSON number `text`,
/// or `None` when it can. Postgres computes, from the digits as written: the display scale,
/// the fraction's digits (trailing zeros included) less the exponent, at most
/// [`MAX_DIGITS_AFTER_POINT`]; and the position of the first significant digit, which must be
/// within [`MAX_DIGITS_BEFORE_POINT`] digits before the point. So `1e131071` and `1e-16383`
/// are stored, `1e131072`, `1e-16384` and `1.0e-16383` are not (tested against Postgres).
pub fn number_fault(text: &str) -> Option<&'static str> {
    let unsigned = text.strip_prefix('-').unwrap_or(text);
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], &unsigned[at + 1..]),
        None => (unsigned, "0"),
    };
    let Some(exponent) = exponent
        .parse::<i64>()
        .ok()
        .filter(|e| e.unsigned_abs() < MAX_EXPONENT)
    else {
        return Some("Postgres's numeric takes an exponent below 1073741823 in size");
    };
    let (int, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if fraction.len() as i64 - exponent > MAX_DIGITS_AFTER_POINT {
        return Some(
            "Postgres's numeric keeps at most 16383 digits after the decimal point, zeros \
             written at the end included",
        );
    }
    // JSON writes no leading zeros: the integer part is "0" or starts with its first
    // significant digit.
    let first_significant = if int != "0" {
        Some(int.len() as i64 - 1)
    } else {
        fraction
            .bytes()
            .position(|d| d != b'0')
            .map(|k| -(k as i64) - 1)
    };
    if first_significant.is_some_and(|p| p + exponent >= MAX_DIGITS_BEFORE_POINT) {
        return Some("Postgres's numeric keeps at most 131072 digits before the decimal point");
    }
    None
}
