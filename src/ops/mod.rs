//! What operators do: the service beneath the JSON API, the console and the CLI; quarantine, replay
//! and tail.

pub mod admin;
pub mod console;
pub mod openapi;
pub mod quarantine;
pub mod replay;
pub mod service;
pub mod tail;
