//! RESP2 replies read off the socket, into redis-rs [`Value`]s.
//!
//! Replies are found whole before any is built: [`end`] walks one reply's lengths without
//! allocating, so a reply split across many reads is scanned again on each read but built once.

use redis::Value;

/// The server sent bytes that are not a RESP2 reply; the connection cannot be trusted after it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a RESP2 reply at byte {at}: {why}")]
pub struct ReplyError {
    at: usize,
    why: &'static str,
}

/// Deepest nesting of arrays accepted: no command the worker sends is answered deeper, and a
/// bound keeps a hostile or broken peer from exhausting the stack.
const MAX_DEPTH: usize = 64;

fn bad(at: usize, why: &'static str) -> ReplyError {
    ReplyError { at, why }
}

/// The index of the `\r` ending the line that starts at `at`, if the whole line has arrived.
fn line_end(buf: &[u8], at: usize) -> Option<usize> {
    let rel = memchr(b'\r', buf.get(at..)?)?;
    let cr = at + rel;
    (cr + 1 < buf.len()).then_some(cr)
}

fn memchr(needle: u8, hay: &[u8]) -> Option<usize> {
    hay.iter().position(|&b| b == needle)
}

fn integer(buf: &[u8], at: usize, cr: usize) -> Result<i64, ReplyError> {
    let text = std::str::from_utf8(&buf[at..cr]).map_err(|_| bad(at, "integer is not ASCII"))?;
    text.parse().map_err(|_| bad(at, "malformed integer"))
}

/// Where the line at `at` ends, checked to end in `\r\n`; None while it has not all arrived.
fn header(buf: &[u8], at: usize) -> Result<Option<usize>, ReplyError> {
    let Some(cr) = line_end(buf, at) else {
        return Ok(None);
    };
    if buf[cr + 1] != b'\n' {
        return Err(bad(cr, "line not ended by CRLF"));
    }
    Ok(Some(cr))
}

/// The index just past the one reply starting at `at`, or None when it has not all arrived.
pub fn end(buf: &[u8], at: usize) -> Result<Option<usize>, ReplyError> {
    let mut at = at;
    // Replies still to be walked: one to begin with, plus each array's elements.
    let mut todo: usize = 1;
    let mut depth = Vec::new();
    while todo > 0 {
        let Some(&kind) = buf.get(at) else {
            return Ok(None);
        };
        let Some(cr) = header(buf, at + 1)? else {
            return Ok(None);
        };
        todo -= 1;
        match kind {
            b'+' | b'-' => at = cr + 2,
            b':' => {
                integer(buf, at + 1, cr)?;
                at = cr + 2;
            }
            b'$' => {
                let len = integer(buf, at + 1, cr)?;
                at = cr + 2;
                if len >= 0 {
                    let len = usize::try_from(len).map_err(|_| bad(at, "bulk too long"))?;
                    let stop = at.checked_add(len).ok_or(bad(at, "bulk too long"))?;
                    if buf.len() < stop + 2 {
                        return Ok(None);
                    }
                    if &buf[stop..stop + 2] != b"\r\n" {
                        return Err(bad(stop, "bulk string not ended by CRLF"));
                    }
                    at = stop + 2;
                } else if len != -1 {
                    return Err(bad(at, "negative bulk length"));
                }
            }
            b'*' => {
                let len = integer(buf, at + 1, cr)?;
                at = cr + 2;
                if len > 0 {
                    let len = usize::try_from(len).map_err(|_| bad(at, "array too long"))?;
                    depth.push(todo);
                    if depth.len() > MAX_DEPTH {
                        return Err(bad(at, "arrays nested too deep"));
                    }
                    todo = len;
                } else if len < -1 {
                    return Err(bad(at, "negative array length"));
                }
            }
            _ => return Err(bad(at, "unknown reply type")),
        }
        while todo == 0 {
            match depth.pop() {
                Some(outer) => todo = outer,
                None => break,
            }
        }
    }
    Ok(Some(at))
}

/// Builds the reply at `*at`, which [`end`] found whole, and moves `*at` past it.
pub fn build(buf: &[u8], at: &mut usize) -> Result<Value, ReplyError> {
    build_at(buf, at, 0)
}

fn build_at(buf: &[u8], at: &mut usize, depth: usize) -> Result<Value, ReplyError> {
    let start = *at;
    let kind = *buf.get(start).ok_or(bad(start, "reply missing"))?;
    let cr = header(buf, start + 1)?.ok_or(bad(start, "reply cut short"))?;
    *at = cr + 2;
    let text = |at: usize| {
        String::from_utf8(buf[at..cr].to_vec()).map_err(|_| bad(at, "status is not UTF-8"))
    };
    Ok(match kind {
        b'+' if &buf[start + 1..cr] == b"OK" => Value::Okay,
        b'+' => Value::SimpleString(text(start + 1)?),
        // Error replies are rare (NOSCRIPT after a restart, a wrong command): redis-rs's own
        // parser turns them into the ServerError its error kinds (NoScript, ...) come from.
        b'-' => redis::parse_redis_value(&buf[start..cr + 2])
            .map_err(|_| bad(start, "unreadable error reply"))?,
        b':' => Value::Int(integer(buf, start + 1, cr)?),
        b'$' => match integer(buf, start + 1, cr)? {
            -1 => Value::Nil,
            len => {
                let len = usize::try_from(len).map_err(|_| bad(start, "negative bulk length"))?;
                let bytes = buf
                    .get(*at..*at + len)
                    .ok_or(bad(*at, "bulk cut short"))?
                    .to_vec();
                *at += len + 2;
                Value::BulkString(bytes)
            }
        },
        b'*' => match integer(buf, start + 1, cr)? {
            -1 => Value::Nil,
            len => {
                if depth >= MAX_DEPTH {
                    return Err(bad(start, "arrays nested too deep"));
                }
                let len = usize::try_from(len).map_err(|_| bad(start, "negative array length"))?;
                let mut items = Vec::with_capacity(len.min(4096));
                for _ in 0..len {
                    items.push(build_at(buf, at, depth + 1)?);
                }
                Value::Array(items)
            }
        },
        _ => return Err(bad(start, "unknown reply type")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(bytes: &[u8]) -> Value {
        assert_eq!(end(bytes, 0), Ok(Some(bytes.len())), "whole reply found");
        let mut at = 0;
        let value = build(bytes, &mut at).expect("reply builds");
        assert_eq!(at, bytes.len());
        value
    }

    #[test]
    fn every_reply_type_is_built_as_redis_rs_parses_it() {
        let replies: [&[u8]; 9] = [
            b"+OK\r\n",
            b"+QUEUED\r\n",
            b":-42\r\n",
            b"$5\r\nhe\r\no\r\n",
            b"$0\r\n\r\n",
            b"$-1\r\n",
            b"*-1\r\n",
            b"*0\r\n",
            b"*3\r\n:1\r\n*2\r\n$1\r\na\r\n*0\r\n$-1\r\n",
        ];
        for bytes in replies {
            let ours = one(bytes);
            let theirs = redis::parse_redis_value(bytes).expect("redis-rs parses it");
            assert_eq!(ours, theirs, "{}", String::from_utf8_lossy(bytes));
        }
    }

    #[test]
    fn an_error_reply_keeps_its_kind_so_noscript_is_recognised() {
        let value = one(b"-NOSCRIPT No matching script. Please use EVAL.\r\n");
        let err = value
            .extract_error()
            .expect_err("an error reply is an error");
        assert_eq!(
            err.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        );
    }

    #[test]
    fn a_reply_cut_anywhere_is_incomplete_until_its_last_byte() {
        let bytes = b"*2\r\n$3\r\nabc\r\n*1\r\n:7\r\n";
        for cut in 0..bytes.len() {
            assert_eq!(end(&bytes[..cut], 0), Ok(None), "cut at {cut}");
        }
        assert_eq!(end(bytes, 0), Ok(Some(bytes.len())));
    }

    #[test]
    fn replies_back_to_back_are_found_one_after_another() {
        let bytes = b":1\r\n$2\r\nhi\r\n*1\r\n+x\r\n";
        let mut at = 0;
        let mut values = Vec::new();
        while let Some(stop) = end(bytes, at).expect("valid") {
            values.push(build(bytes, &mut at).expect("builds"));
            assert_eq!(at, stop);
        }
        assert_eq!(
            values,
            [
                Value::Int(1),
                Value::BulkString(b"hi".to_vec()),
                Value::Array(vec![Value::SimpleString("x".into())])
            ]
        );
    }

    #[test]
    fn bytes_that_are_not_resp2_are_refused() {
        let broken: [&[u8]; 6] = [
            b"!oops\r\n",
            b":12x\r\n",
            b"$3\r\nabcd\r\n",
            b"$-2\r\n",
            b"*-5\r\n",
            b":1\rX",
        ];
        for bytes in broken {
            assert!(
                end(bytes, 0).is_err(),
                "{} refused",
                String::from_utf8_lossy(bytes)
            );
        }
        let deep = "*1\r\n".repeat(MAX_DEPTH + 1) + ":1\r\n";
        assert!(end(deep.as_bytes(), 0).is_err(), "nesting bounded");
    }
}
