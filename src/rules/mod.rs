//! Which rules apply: the policy file, each limiter kind, priority and live reload.

pub mod kinds;
pub mod policy;
pub mod priority;
pub mod reload;
