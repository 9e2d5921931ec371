//! Whether the worker takes deliveries, for readiness: set by the broker sessions, read by the
//! admin API's `/readyz`.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether the worker's consumer is running, and whether the broker blocks its publishing
/// connection; readiness reports both.
#[derive(Debug, Default)]
pub struct Health {
    consuming: AtomicBool,
    blocked: std::sync::Mutex<Option<String>>,
}

impl Health {
    /// Records whether deliveries are being taken.
    pub fn set_consuming(&self, on: bool) {
        self.consuming.store(on, Ordering::SeqCst);
    }

    /// Whether deliveries are being taken.
    pub fn consuming(&self) -> bool {
        self.consuming.load(Ordering::SeqCst)
    }

    /// Records the broker's reason for blocking the publishing connection (`None`: not
    /// blocked). No delivery is taken meanwhile.
    pub fn set_blocked(&self, reason: Option<String>) {
        *self.blocked.lock().unwrap_or_else(|p| p.into_inner()) = reason;
    }

    /// Why the broker blocks the publishing connection, if it does.
    pub fn blocked(&self) -> Option<String> {
        self.blocked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}
