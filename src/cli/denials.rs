//! The denial history's commands: `denials` (a page of it, as a table, CSV or JSON lines),
//! `replay` (publish denied messages again) and `prune` (drop old months). The table's and the
//! CSV's columns and cells come from the denial columns ([`columns::table`], [`columns::csv`]),
//! the JSON from the denial's own.

use std::io::Write;

use chrono::{DateTime, Utc};
use clap::ValueEnum;

use super::{
    connect_reads, connect_store, open_publisher, parse_since, rfc3339, service, CliError,
};
use crate::base::clock::Clock;
use crate::base::config::Settings;
use crate::intake::broker::Names;
use crate::record::denials::{columns, Denial, DenialFilter, Reads};

/// Filters shared by `denials` and `replay`.
#[derive(Debug, clap::Args)]
pub struct FilterArgs {
    /// Only this recipient.
    #[arg(long)]
    recipient: Option<String>,
    /// Only this rule.
    #[arg(long)]
    rule: Option<String>,
    /// Only this channel.
    #[arg(long)]
    channel: Option<String>,
    /// Only this category.
    #[arg(long)]
    category: Option<String>,
    /// Denied at or after: RFC3339, or an age such as 7d, 36h, 90m.
    #[arg(long)]
    since: Option<String>,
    /// Denied before: RFC3339, or an age such as 7d, 36h, 90m.
    #[arg(long)]
    until: Option<String>,
}

impl FilterArgs {
    fn filter(self, now: DateTime<Utc>) -> Result<DenialFilter, CliError> {
        Ok(DenialFilter {
            recipient: self.recipient,
            rule: self.rule,
            channel: self.channel,
            category: self.category,
            since: self
                .since
                .map(|s| parse_since("--since", &s, now))
                .transpose()?,
            until: self
                .until
                .map(|s| parse_since("--until", &s, now))
                .transpose()?,
            ..DenialFilter::default()
        })
    }
}

/// Filters and format of `denials`.
#[derive(Debug, clap::Args)]
pub struct DenialArgs {
    #[command(flatten)]
    filter: FilterArgs,
    /// Only shadow denials (true) or only real ones (false).
    #[arg(long)]
    shadow: Option<bool>,
    /// Only unchecked dispatches (true: sent unchecked while Redis was unavailable) or only the
    /// other rows (false).
    #[arg(long)]
    unchecked: Option<bool>,
    /// Only replayed denials (true) or only unreplayed ones (false).
    #[arg(long)]
    replayed: Option<bool>,
    /// Continue after this denial id (the last id of the previous page).
    #[arg(long)]
    after: Option<i64>,
    /// At most this many rows.
    #[arg(long, default_value_t = 100)]
    limit: i64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// What `replay` takes.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    filter: FilterArgs,
    /// Only denials whose retry_after has passed.
    #[arg(long)]
    due: bool,
    /// List what would be replayed; publish and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// At most this many denials.
    #[arg(long)]
    limit: Option<usize>,
    /// At most this many publishes per second: `50/s`, `50`, `300/m`.
    #[arg(long)]
    rate: Option<String>,
    /// Denials claimed per transaction. A crash republishes at most one batch (the quota
    /// recognises those ids), so the default claims one at a time.
    #[arg(long, default_value_t = 1)]
    batch: i64,
}

/// Output formats of `denials`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Format {
    /// Aligned columns for people.
    Table,
    /// One JSON object per line.
    Json,
    /// Comma-separated values with a header line.
    Csv,
}

/// `denials`: a page of the history, newest first.
pub(super) async fn denials(
    settings: &Settings,
    clock: &dyn Clock,
    args: DenialArgs,
) -> Result<(), CliError> {
    if args.limit < 1 {
        return Err(CliError::Input("--limit must be at least 1".to_owned()));
    }
    let filter = DenialFilter {
        shadow: args.shadow,
        unchecked: args.unchecked,
        replayed: args.replayed,
        after: args.after,
        limit: args.limit,
        ..args.filter.filter(clock.now())?
    };
    let reads = connect_reads(settings).await?;
    let rows = reads
        .list(&filter)
        .await
        .map_err(|e| service("postgres")(&e))?;
    print_denials(&rows, args.format)
}

fn print_denials(rows: &[Denial], format: Format) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    let written = match format {
        Format::Json => rows.iter().try_for_each(|d| {
            let line = serde_json::to_string(d).map_err(std::io::Error::other)?;
            writeln!(out, "{line}")
        }),
        Format::Csv => write_csv(&mut out, rows),
        Format::Table => write_table(&mut out, rows),
    };
    written.map_err(|e| CliError::Service(format!("writing output: {e}")))
}

/// `replay`: publishes the matching denials' messages again (or lists them, `--dry-run`).
pub(super) async fn replay(
    settings: &Settings,
    clock: &dyn Clock,
    args: ReplayArgs,
) -> Result<(), CliError> {
    let now = clock.now();
    let rate = match args.rate.as_deref() {
        Some(text) => Some(crate::ops::replay::parse_rate(text).ok_or_else(|| {
            CliError::Input(format!(
                "--rate {text:?} is not a rate such as 50/s, 50 or 300/m"
            ))
        })?),
        None => None,
    };
    if args.batch < 1 || args.limit == Some(0) {
        return Err(CliError::Input(
            "--batch and --limit must be at least 1".to_owned(),
        ));
    }
    let options = crate::ops::replay::ReplayOptions {
        filter: DenialFilter {
            due_at: args.due.then_some(now),
            live_at: Some(now),
            ..args.filter.filter(now)?
        },
        limit: args.limit,
        rate,
        batch: args.batch,
    };
    if args.dry_run {
        return dry_run(&connect_reads(settings).await?, &options, now).await;
    }
    let store = connect_store(settings).await?;
    let names = Names::of_settings(settings);
    let (connection, publisher) = open_publisher(settings, &names, "sendquota-replay").await?;
    let bar = progress_bar(args.limit);
    let result = crate::ops::replay::replay(
        &store,
        &publisher,
        &names,
        &options,
        || clock.now(),
        |n| bar.set_position(n as u64),
    )
    .await;
    bar.finish_and_clear();
    let _ = connection.close(200, "done".into()).await;
    let report = result.map_err(|e| CliError::Service(e.to_string()))?;
    let secs = report.elapsed.as_secs_f64();
    println!(
        "replayed {} denials in {secs:.2} s ({:.1}/s)",
        report.replayed,
        report.replayed as f64 / secs.max(1e-9)
    );
    Ok(())
}

/// `replay --dry-run`: the denials a replay at `now` would publish, as a table, and how many
/// it would skip for their deadline; nothing is claimed or published.
async fn dry_run(
    store: &Reads,
    options: &crate::ops::replay::ReplayOptions,
    now: DateTime<Utc>,
) -> Result<(), CliError> {
    let limit = options
        .limit
        .map_or(crate::record::denials::MAX_LIMIT, |l| l as i64);
    let rows = store
        .replayable(&options.filter, limit)
        .await
        .map_err(|e| service("postgres")(&e))?;
    let past_deadline = store
        .past_deadline(&options.filter, now)
        .await
        .map_err(|e| service("postgres")(&e))?;
    print_denials(&rows, Format::Table)?;
    println!("dry run: would replay {} denials", rows.len());
    if past_deadline > 0 {
        println!(
            "dry run: skipped {past_deadline} denials whose message is past its deadline \
             (expires_at)"
        );
    }
    Ok(())
}

/// A progress bar on stderr when it is a terminal; hidden otherwise (cron, pipes).
fn progress_bar(len: Option<usize>) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = match len {
        Some(n) => indicatif::ProgressBar::new(n as u64),
        None => indicatif::ProgressBar::no_length(),
    };
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    bar
}

/// `prune`: drops the monthly partitions older than `older_than`.
pub(super) async fn prune(
    settings: &Settings,
    clock: &dyn Clock,
    older_than: &str,
) -> Result<(), CliError> {
    let now = clock.now();
    let cutoff = parse_since("--older-than", older_than, now)?;
    if cutoff > now {
        return Err(CliError::Input(
            "--older-than must be an age such as 90d".to_owned(),
        ));
    }
    let store = connect_store(settings).await?;
    let dropped = store
        .prune(cutoff)
        .await
        .map_err(|e| service("postgres")(&e))?;
    for name in &dropped {
        println!("dropped {name}");
    }
    println!(
        "pruned {} partitions older than {}",
        dropped.len(),
        rfc3339(cutoff)
    );
    Ok(())
}

/// `rows` as a table: the table's columns aligned, two spaces apart, a header line first.
fn write_table(out: &mut impl Write, rows: &[Denial]) -> std::io::Result<()> {
    let columns = columns::table();
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|d| columns.iter().map(|c| c.cell(d).into_owned()).collect())
        .collect();
    let mut widths: Vec<usize> = columns.iter().map(|c| c.name.len()).collect();
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        cells
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_owned()
    };
    writeln!(out, "{}", line(&mut columns.iter().map(|c| c.name)))?;
    for row in &cells {
        writeln!(out, "{}", line(&mut row.iter().map(String::as_str)))?;
    }
    Ok(())
}

/// `rows` as CSV: the CSV's columns, a header line first, fields quoted where they must be.
fn write_csv(out: &mut impl Write, rows: &[Denial]) -> std::io::Result<()> {
    fn field(s: &str) -> std::borrow::Cow<'_, str> {
        if s.contains([',', '"', '\n', '\r']) {
            format!("\"{}\"", s.replace('"', "\"\"")).into()
        } else {
            s.into()
        }
    }
    let columns = columns::csv();
    let names: Vec<&str> = columns.iter().map(|c| c.name).collect();
    writeln!(out, "{}", names.join(","))?;
    for d in rows {
        let cells: Vec<String> = columns
            .iter()
            .map(|c| field(&c.cell(d)).into_owned())
            .collect();
        writeln!(out, "{}", cells.join(","))?;
    }
    Ok(())
}
