//! What comes in: a broker session's deliveries and what settles them.

pub mod acks;
pub mod broker;
pub mod confirms;
pub mod delays;
pub mod nodes;
pub mod publisher;
pub mod sequence;
pub mod shards;
pub mod worker;
