//! Act: making a decided outcome durable. The pipeline ([`pipeline`]) takes one delivery
//! through its decision to the step for its outcome ([`steps`]); the digest flusher
//! ([`digest`]) sends the messages `digest` rules hold ([`held`]) through the same steps.

pub mod digest;
pub mod held;
pub mod pipeline;
pub mod steps;
