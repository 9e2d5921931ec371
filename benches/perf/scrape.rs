//! The worker's Prometheus endpoint read from outside, as a scraper would: a bare HTTP/1.0 GET
//! on its admin port, histograms (summed over label sets and over runs, quantiles interpolated
//! as PromQL's histogram_quantile) and counters. The bench takes the worker's own latency
//! figures from here rather than timing from outside, where the broker's share would mix in.

use std::collections::BTreeMap;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The body of `GET path` on the worker's admin port when it answers 200; `None` when it does
/// not listen yet or answers anything else (the readiness poll asks every millisecond, so a
/// failure is an answer, not a panic).
pub async fn http_get(port: u16, path: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let req = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.")
        .then(|| head.contains(" 200 "))
        .filter(|ok| *ok)
        .map(|_| body.to_owned())
}

/// A Prometheus histogram's cumulative buckets (upper bound, count), summed over label sets.
pub struct Histogram {
    buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

pub fn histogram(metrics: &str, name: &str) -> Histogram {
    let mut buckets = Vec::new();
    let (mut sum, mut count) = (0.0, 0.0);
    let value = |line: &str| -> f64 {
        line.rsplit(' ')
            .next()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    for line in metrics.lines() {
        if let Some(rest) = line.strip_prefix(&format!("{name}_bucket")) {
            let le = rest
                .split("le=\"")
                .nth(1)
                .and_then(|s| s.split('"').next())
                .map(|s| {
                    if s == "+Inf" {
                        f64::INFINITY
                    } else {
                        s.parse().unwrap_or(f64::INFINITY)
                    }
                })
                .unwrap_or(f64::INFINITY);
            buckets.push((le, value(line)));
        } else if line.starts_with(&format!("{name}_sum")) {
            sum += value(line);
        } else if line.starts_with(&format!("{name}_count")) {
            count += value(line);
        }
    }
    Histogram::summed(buckets, sum, count)
}

impl Histogram {
    /// A histogram from (upper bound, cumulative count) pairs, the counts of equal bounds added
    /// (several label sets of one scrape, or two scrapes).
    fn summed(pairs: impl IntoIterator<Item = (f64, f64)>, sum: f64, count: f64) -> Histogram {
        let mut buckets: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for (le, n) in pairs {
            // Non-negative floats order like their bit patterns.
            buckets.entry(le.to_bits()).or_insert((le, 0.0)).1 += n;
        }
        Histogram {
            buckets: buckets.into_values().collect(),
            sum,
            count,
        }
    }

    /// Two scrapes' histograms as one: counts added bucket by bucket.
    pub fn plus(self, o: Histogram) -> Histogram {
        Histogram::summed(
            self.buckets.into_iter().chain(o.buckets),
            self.sum + o.sum,
            self.count + o.count,
        )
    }

    /// The q-quantile, interpolated linearly inside its bucket (as PromQL's
    /// histogram_quantile); the last finite bound when it falls in the +Inf bucket.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, cumulative) in &self.buckets {
            if cumulative >= rank {
                if le.is_infinite() {
                    return Some(lower);
                }
                let share = if cumulative > below {
                    (rank - below) / (cumulative - below)
                } else {
                    0.0
                };
                return Some(lower + (le - lower) * share);
            }
            lower = le;
            below = cumulative;
        }
        Some(lower)
    }
}

/// The value of counter `name` with label `kind` in a Prometheus scrape; 0 when absent.
pub fn counter(metrics: &str, name: &str, kind: Option<&str>) -> f64 {
    let series = match kind {
        Some(kind) => format!("{name}{{kind=\"{kind}\"}} "),
        None => format!("{name} "),
    };
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}
