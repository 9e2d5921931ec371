//! The send request: its type, decode and validation, the name grammar, attributes and the JSON
//! Schema producers read.

pub mod attributes;
pub mod message;
pub mod names;
pub mod priority;
pub mod schema;
