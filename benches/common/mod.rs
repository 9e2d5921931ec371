//! What the benches share beyond the tests' harness: their command-line flags and Redis's
//! per-command statistics.

/// A bench's `--name VALUE` argument, or `default`; exits 2 with a clear line on a bad value.
pub fn flag<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                eprintln!("{name} takes a number");
                std::process::exit(2)
            }),
        None => default,
    }
}

/// `INFO commandstats`: command -> (calls, microseconds executing it), server-wide (every
/// client of the server counts). Commands a script runs are counted too, and their time is also
/// inside the script's. The benches read it before and after a phase.
pub async fn command_stats(
    conn: &mut impl redis::aio::ConnectionLike,
) -> std::collections::BTreeMap<String, (u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap_or_default();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let field = |f: &str| -> u64 {
                rest.split(',')
                    .find_map(|kv| kv.strip_prefix(f))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            Some((name.to_owned(), (field("calls="), field("usec="))))
        })
        .collect()
}
