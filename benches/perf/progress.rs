//! Progress lines on stderr, at most one a second per phase: a full run takes minutes, and a
//! phase that stalls (a broker that stopped delivering, say) shows where.

use std::time::{Duration, Instant};

/// Prints a progress line on stderr at most once a second.
pub struct Progress {
    label: String,
    total: usize,
    pub done: usize,
    began: Instant,
    last: Instant,
}

impl Progress {
    pub fn new(label: &str, total: usize) -> Progress {
        eprintln!("[{label}] {total} to go");
        Progress {
            label: label.to_owned(),
            total,
            done: 0,
            began: Instant::now(),
            last: Instant::now(),
        }
    }

    /// Counts `k` more done.
    pub fn add(&mut self, k: usize) {
        self.done += k;
        if self.last.elapsed() >= Duration::from_secs(1) {
            self.last = Instant::now();
            eprintln!(
                "[{}] {}/{} after {:.1} s",
                self.label,
                self.done,
                self.total,
                self.began.elapsed().as_secs_f64()
            );
        }
    }
}
