//! A lean AMQP 0-9-1 client on the tokio runtime, for the worker's hot path.
//!
//! Why not lapin: lapin runs its socket on a thread of its own and hands every frame
//! across threads, so each delivery, publish and confirm wakes another thread. Measured with
//! the perf bench's floor (the worker's broker work with nothing decided), lapin cost about
//! twice this client's CPU per message (README, "Dependencies"). Here one reader task parses frames and routes
//! them straight to the waiting futures, and one writer task sends everything the tasks queued
//! since its last write in one system call. Frames are parsed and written by `amq-protocol`,
//! the protocol crate lapin itself uses.
//!
//! It implements what the worker needs and nothing else: PLAIN login, channels, publisher
//! confirms (with mandatory returns), consumers with manual acks, qos, and the declarations of
//! the worker's topology. A channel or connection error fails every operation waiting on it
//! with the broker's reply code and text.

mod channel;
mod connection;
mod wire;

pub use amq_protocol::protocol::BasicProperties;
pub use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
pub use amq_protocol::uri::AMQPUri;
pub use channel::{Channel, Confirmation, Consumer};
pub use connection::Connection;

/// What can go wrong talking to the broker. Cloneable: one lost connection fails every
/// operation waiting on it with the same error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmqpError {
    /// The URL is not a valid `amqp://` URL.
    #[error("invalid AMQP URL: {0}")]
    Url(String),
    /// The socket failed or the broker went away.
    #[error("connection lost: {0}")]
    Io(String),
    /// The broker sent something this client does not understand, or refused the handshake.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The broker closed the connection.
    #[error("connection closed by the broker: {code} {text}")]
    ConnectionClosed {
        /// AMQP reply code (320 = forced shutdown, 403 = access refused, ...).
        code: u16,
        /// The broker's explanation.
        text: String,
    },
    /// The broker closed the channel (for example 404: no such exchange or queue).
    #[error("channel closed by the broker: {code} {text}")]
    ChannelClosed {
        /// AMQP reply code.
        code: u16,
        /// The broker's explanation.
        text: String,
    },
    /// This side closed the connection or channel, or dropped it.
    #[error("closed: {0}")]
    Closed(&'static str),
    /// The broker cancelled the consumer (its queue was deleted).
    #[error("consumer cancelled by the broker")]
    ConsumerCancelled,
    /// A name does not fit in AMQP's 255-byte short string.
    #[error("name too long for AMQP: {0:?}")]
    NameTooLong(String),
}

/// A message delivered to a consumer.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Tag to ack or nack it with, on the channel it came from.
    pub delivery_tag: u64,
    /// Whether the broker delivered it before (to this or another consumer).
    pub redelivered: bool,
    /// The exchange it was published to.
    pub exchange: String,
    /// The routing key it was published with.
    pub routing_key: String,
    /// Its properties (headers, message id, content type, ...).
    pub properties: BasicProperties,
    /// Its body.
    pub data: Vec<u8>,
}

/// `s` as a short string, or an error naming it.
pub fn short(s: &str) -> Result<ShortString, AmqpError> {
    ShortString::try_new(s).map_err(|_| AmqpError::NameTooLong(s.to_owned()))
}
