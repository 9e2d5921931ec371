//! The decision: the limiter's one Lua call per scope (with its keys, claim, dedup and deny cache)
//! and the pure composer that turns its verdicts into one outcome.

pub mod claim;
pub mod deadline;
pub mod decision;
pub mod dedup;
pub mod deny_cache;
pub mod keys;
pub mod limiter;
pub mod mark_batch;
pub mod outcome;
