//! What is kept after a decision: the denial history and the per-minute counts.

pub mod denials;
pub mod rollup;
