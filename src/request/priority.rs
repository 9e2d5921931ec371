//! How urgent a message is: the [`Priority`] a request carries. It belongs to the request
//! (decode reads it, the schema lists it); what a rule does about it lives in
//! `rules::priority`.

use serde::Serialize;

/// How urgent a message is. Ordered: `Low < Normal < High < Critical`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Can wait, or be dropped first (a digest, a newsletter).
    Low,
    /// Everything not marked otherwise.
    #[default]
    Normal,
    /// Should not be held back by routine traffic (a reminder the user asked for).
    High,
    /// Must never be eaten by a cap (a password reset, a security alert).
    Critical,
}

impl Priority {
    /// Every priority, lowest first: the values a request and a rule may name.
    pub const ALL: [Priority; 4] = [
        Priority::Low,
        Priority::Normal,
        Priority::High,
        Priority::Critical,
    ];

    /// The name a request and configuration use.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Low => "low",
            Priority::Normal => "normal",
            Priority::High => "high",
            Priority::Critical => "critical",
        }
    }

    /// The priority named `name`, if it is one.
    pub fn parse(name: &str) -> Option<Priority> {
        Priority::ALL.into_iter().find(|p| p.as_str() == name)
    }

    /// The names of [`Priority::ALL`], for error messages: `critical, high, normal or low`.
    pub fn names() -> String {
        let names: Vec<&str> = Priority::ALL.iter().rev().map(|p| p.as_str()).collect();
        format!(
            "{} or {}",
            names[..names.len() - 1].join(", "),
            names[names.len() - 1]
        )
    }
}
