//! AMQP 0-9-1 frames to and from bytes: `amq-protocol` parses and writes the methods and
//! properties; this module frames them, splits bodies and finds frame boundaries in a stream.

use amq_protocol::frame::{parse_frame, AMQPFrame};
use amq_protocol::protocol::{basic::gen_properties, constants, AMQPClass, BasicProperties};

use super::AmqpError;

/// Bytes around every frame's payload: type, channel, size, and the end marker.
const FRAME_OVERHEAD: usize = 8;

/// Content class of `basic.*` methods, the only class that carries content.
const BASIC_CLASS: u16 = 60;

/// Appends a method frame.
pub(super) fn method(out: &mut Vec<u8>, channel: u16, method: AMQPClass) -> Result<(), AmqpError> {
    let frame = AMQPFrame::Method(channel, method);
    let buf = std::mem::take(out);
    let (buf, _) = cookie_factory::gen(amq_protocol::frame::gen_frame(&frame), buf)
        .map_err(|e| AmqpError::Protocol(format!("cannot encode a method: {e}")))?;
    *out = buf;
    Ok(())
}

/// Appends a message's content: a header frame with `properties`, then `body` in frames of at
/// most `frame_max` bytes.
pub(super) fn content(
    out: &mut Vec<u8>,
    channel: u16,
    properties: &BasicProperties,
    body: &[u8],
    frame_max: usize,
) -> Result<(), AmqpError> {
    let start = out.len();
    out.push(constants::FRAME_HEADER);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&BASIC_CLASS.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    let buf = std::mem::take(out);
    let (buf, _) = cookie_factory::gen(gen_properties(properties), buf)
        .map_err(|e| AmqpError::Protocol(format!("cannot encode message properties: {e}")))?;
    *out = buf;
    let size = u32::try_from(out.len() - start - 7)
        .map_err(|_| AmqpError::Protocol("message properties too large".into()))?;
    out[start + 3..start + 7].copy_from_slice(&size.to_be_bytes());
    out.push(constants::FRAME_END);
    for chunk in body.chunks(frame_max.saturating_sub(FRAME_OVERHEAD).max(1)) {
        out.push(constants::FRAME_BODY);
        out.extend_from_slice(&channel.to_be_bytes());
        out.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
        out.extend_from_slice(chunk);
        out.push(constants::FRAME_END);
    }
    Ok(())
}

/// Appends a heartbeat frame.
pub(super) fn heartbeat(out: &mut Vec<u8>) {
    out.extend_from_slice(&[
        constants::FRAME_HEARTBEAT,
        0,
        0,
        0,
        0,
        0,
        0,
        constants::FRAME_END,
    ]);
}

/// The first complete frame in `buf` and the bytes it took, or `None` when more bytes are
/// needed. A frame larger than `frame_max` is an error: the peer broke the agreed limit, or
/// the stream is not AMQP.
pub(super) fn next_frame(
    buf: &[u8],
    frame_max: usize,
) -> Result<Option<(AMQPFrame, usize)>, AmqpError> {
    if buf.len() < 7 {
        return Ok(None);
    }
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as usize;
    if size + FRAME_OVERHEAD > frame_max.max(4096) {
        return Err(AmqpError::Protocol(format!(
            "frame of {size} bytes exceeds the negotiated maximum of {frame_max}"
        )));
    }
    let len = size + FRAME_OVERHEAD;
    if buf.len() < len {
        return Ok(None);
    }
    match parse_frame(&buf[..len]) {
        Ok(([], frame)) => Ok(Some((frame, len))),
        Ok(_) => Err(AmqpError::Protocol("frame longer than its size".into())),
        Err(e) => Err(AmqpError::Protocol(format!("unparsable frame: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::basic;

    #[test]
    fn content_frames_parse_back_to_the_properties_and_body_split_at_frame_max() {
        let properties = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_delivery_mode(2);
        let body: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let mut out = Vec::new();
        content(&mut out, 3, &properties, &body, 4096).unwrap();
        let mut at = 0;
        let mut bodies = Vec::new();
        let mut header = None;
        while let Some((frame, len)) = next_frame(&out[at..], 4096).unwrap() {
            at += len;
            match frame {
                AMQPFrame::Header(3, h) => header = Some(h),
                AMQPFrame::Body(3, b) => bodies.push(b),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(at, out.len());
        let header = header.expect("a header frame");
        assert_eq!(header.body_size, 10_000);
        assert_eq!(header.properties, properties);
        assert_eq!(bodies.len(), 3, "4088-byte payloads: 4088 + 4088 + 1824");
        assert_eq!(bodies.concat(), body);
    }

    #[test]
    fn a_partial_frame_waits_for_more_bytes_and_an_oversized_one_is_refused() {
        let mut out = Vec::new();
        let ack = basic::Ack {
            delivery_tag: 7,
            multiple: true,
        };
        method(&mut out, 1, AMQPClass::Basic(basic::AMQPMethod::Ack(ack))).unwrap();
        assert!(next_frame(&out[..out.len() - 1], 4096).unwrap().is_none());
        let (frame, len) = next_frame(&out, 4096).unwrap().unwrap();
        assert_eq!(len, out.len());
        assert!(matches!(
            frame,
            AMQPFrame::Method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: 7,
                    multiple: true
                }))
            )
        ));
        let huge = [1u8, 0, 1, 0x10, 0, 0, 0];
        assert!(matches!(
            next_frame(&huge, 4096),
            Err(AmqpError::Protocol(_))
        ));
    }
}
