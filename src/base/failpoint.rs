//! Deliberate faults for crash tests: a worker that hangs at exactly the point a test means to
//! kill it, a consumer that silently stops, messages that fail while others go through,
//! messages that stay in flight for a while. They are compiled in only with the cargo feature
//! `failpoints`, which the test command turns on; in any other build no check is made (each
//! compiles to `false`) and `SENDQUOTA_FAILPOINT` is refused at start.

/// One fault, armed for the worker's whole life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// Hang forever after the limiter committed an allowed message, before dispatching it.
    HangAfterAdmit,
    /// The first broker session stops taking deliveries without any error, as a consumer
    /// that silently died would; the watchdog must notice and restart the session.
    StallConsumerOnce,
    /// Every attempt at a message whose id starts with `stuck-` fails as if Redis were away,
    /// while every other message goes through: failures specific to some messages, which must
    /// not hold every slot.
    FailStuckIds,
    /// Every attempt at a message whose id starts with `slow-` waits [`SLOW_IDS_HOLD`] before
    /// it is decided: deliveries that stay in flight for a while, as behind a slow service.
    /// A digest to a recipient whose name starts with `slow-` waits as long before its
    /// publish: a worker stalled while sending one.
    SlowIds,
    /// For every recipient whose name starts with `gone-`, the step right after a decision
    /// fails, every time: Redis goes away after a script refused the message (before its
    /// refunds and the deny cache), Postgres after the limiter admitted a digest (before its
    /// items are bound to it), Redis after a digest's publish (its dispatch marks). What a
    /// service failing between two steps leaves must be retried, never let out.
    FailAfterDecision,
    /// Every refund made while quarantining a message to a recipient whose name starts with
    /// `gone-` fails as if Redis went away: a service failing between the steps of a
    /// quarantine must neither leave a copy in the quarantine queue nor keep what the message
    /// took.
    FailQuarantineRefund,
}

/// How long [`Failpoint::SlowIds`] holds each attempt: far longer than healing the topology
/// takes, far shorter than the default shutdown timeout, so a test tells them apart.
pub const SLOW_IDS_HOLD: std::time::Duration = std::time::Duration::from_secs(6);

/// The recipients [`Failpoint::FailAfterDecision`] fails.
pub const FAILING_RECIPIENT_PREFIX: &str = "gone-";

/// Whether [`Failpoint::FailAfterDecision`] is armed and fails the step after a decision
/// about a message to `recipient`.
pub fn fails_after_decision(armed: Option<Failpoint>, recipient: &str) -> bool {
    self::armed(armed, Failpoint::FailAfterDecision)
        && recipient.starts_with(FAILING_RECIPIENT_PREFIX)
}

/// The I/O error a failpoint stands in for a service going away with.
pub fn gone(which: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionReset,
        format!("failpoint {which}"),
    )
}

/// Whether this build has failpoints (the cargo feature `failpoints`).
pub fn enabled() -> bool {
    cfg!(feature = "failpoints")
}

/// Whether `which` is the armed failpoint, in a build that has failpoints.
pub fn armed(armed: Option<Failpoint>, which: Failpoint) -> bool {
    enabled() && armed == Some(which)
}

/// The failpoint named by `SENDQUOTA_FAILPOINT`'s value, or why there is none.
pub fn parse(value: &str) -> Result<Failpoint, String> {
    if !enabled() {
        return Err(format!(
            "SENDQUOTA_FAILPOINT={value:?}: this build has no failpoints (cargo feature \
             `failpoints`, for tests only)"
        ));
    }
    match value {
        "hang-after-admit" => Ok(Failpoint::HangAfterAdmit),
        "stall-consumer-once" => Ok(Failpoint::StallConsumerOnce),
        "fail-stuck-ids" => Ok(Failpoint::FailStuckIds),
        "slow-ids" => Ok(Failpoint::SlowIds),
        "fail-after-decision" => Ok(Failpoint::FailAfterDecision),
        "fail-quarantine-refund" => Ok(Failpoint::FailQuarantineRefund),
        other => Err(format!("unknown SENDQUOTA_FAILPOINT {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "failpoints")]
    #[test]
    fn a_test_build_knows_every_failpoint_by_name() {
        assert_eq!(parse("hang-after-admit"), Ok(Failpoint::HangAfterAdmit));
        assert_eq!(
            parse("stall-consumer-once"),
            Ok(Failpoint::StallConsumerOnce)
        );
        assert_eq!(parse("fail-stuck-ids"), Ok(Failpoint::FailStuckIds));
        assert_eq!(parse("slow-ids"), Ok(Failpoint::SlowIds));
        assert_eq!(
            parse("fail-after-decision"),
            Ok(Failpoint::FailAfterDecision)
        );
        assert_eq!(
            parse("fail-quarantine-refund"),
            Ok(Failpoint::FailQuarantineRefund)
        );
        assert!(parse("nope").is_err());
        assert!(armed(
            Some(Failpoint::FailStuckIds),
            Failpoint::FailStuckIds
        ));
    }

    #[cfg(not(feature = "failpoints"))]
    #[test]
    fn a_production_build_refuses_failpoints_and_checks_none() {
        let refused = parse("hang-after-admit").expect_err("no failpoints");
        assert!(
            refused.contains("this build has no failpoints"),
            "{refused}"
        );
        assert!(!armed(
            Some(Failpoint::HangAfterAdmit),
            Failpoint::HangAfterAdmit
        ));
    }
}
