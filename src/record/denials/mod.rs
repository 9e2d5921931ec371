//! The denial history in Postgres: written by the worker, read by operators.
//!
//! A denial row is written before its message is acked, so a denial is never lost; the unique
//! event index makes the write idempotent, so a redelivered message adds no second row.

pub mod columns;
mod query;
mod reads;
mod sql;
mod writer;

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

use crate::base::config::DatabaseSettings;
use crate::request::message::SendRequest;

pub use query::{DenialFilter, MAX_LIMIT};
pub use reads::{ReadError, Reads};
pub use writer::DenialWriter;

/// SQLSTATE of an insert whose row falls in no partition (check_violation).
const NO_PARTITION: &str = "23514";

/// One denial event (recipient, message, rule, replay), for finding repeats within a batch;
/// borrowed, so a batch allocates no key per row. Message ids are unique per recipient.
type EventKey<'a> = (&'a str, &'a str, &'a str, i64);

fn event_key<'a>(
    recipient: &'a str,
    message_id: &'a str,
    rule: &'a str,
    replay_of: Option<i64>,
) -> EventKey<'a> {
    (recipient, message_id, rule, replay_of.unwrap_or(0))
}

/// The rows a replay may take: not replayed yet, and records of a message that was not sent
/// (a shadow row's and an unchecked row's message went out).
const REPLAYABLE: &str = "replayed_at IS NULL AND NOT shadow AND NOT unchecked";

/// Migrations, compiled in so the binary can apply them without the source tree.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Failures of the denial store.
#[derive(Debug, thiserror::Error)]
pub enum DenialError {
    /// The URL could not be parsed.
    #[error("bad database URL: {0}")]
    Url(String),
    /// Postgres could not be reached or failed the statement.
    #[error("postgres: {0}")]
    Database(#[from] sqlx::Error),
    /// Migrations could not be applied.
    #[error("postgres migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The batch this denial was in failed (the message is retried).
    #[error("postgres (batched write): {0}")]
    Batch(String),
    /// Postgres refused this denial's row itself, with a data error (SQLSTATE class 22, such
    /// as a payload number beyond its numeric type): writing it again cannot succeed.
    #[error("postgres refused the denial row (SQLSTATE {sqlstate}): {message}")]
    Refused {
        /// The SQLSTATE.
        sqlstate: String,
        /// Postgres's message.
        message: String,
    },
    /// The batching task is gone (the worker is stopping).
    #[error("the denial writer stopped")]
    WriterStopped,
}

impl DenialError {
    /// The refusal of this row, when Postgres failed it with a data error (SQLSTATE class 22):
    /// a fault of the data, not of the service.
    pub fn data_refusal(&self) -> Option<DenialError> {
        let DenialError::Database(e) = self else {
            return None;
        };
        let db = e.as_database_error()?;
        let code = db.code()?;
        code.starts_with("22").then(|| DenialError::Refused {
            sqlstate: code.into_owned(),
            message: crate::request::message::one_line(db.message()),
        })
    }
}

/// A denial row: the one shape of a denial, written by the worker and read by operators (as
/// [`Denial`], which adds what Postgres assigns). Its columns are listed once, in
/// [`columns::COLUMNS`], from which the statements and every output are built. `Default` is
/// for struct update: [`DenialRow::for_message`] and tests name only what they set.
#[derive(Debug, Clone, PartialEq, Default, sqlx::FromRow)]
pub struct DenialRow {
    /// The producer's message id.
    pub message_id: String,
    /// The recipient.
    pub recipient: String,
    /// The channel.
    pub channel: String,
    /// The category.
    pub category: String,
    /// The refusing rule's name.
    pub rule: String,
    /// The refusing rule's kind.
    pub kind: String,
    /// Why it refused.
    pub reason: String,
    /// Whether the rule is in shadow mode (a would-be denial: the message was dispatched).
    pub shadow: bool,
    /// When the message could be sent.
    pub retry_after: Option<DateTime<Utc>>,
    /// The request, as the JSON text the worker wrote ([`SendRequest::to_json_text`]).
    pub message: StoredMessage,
    /// The decision instant (the worker's clock).
    pub denied_at: DateTime<Utc>,
    /// The denial a replayed message came from, if it is a replay.
    pub replay_of: Option<i64>,
    /// The message's deadline (see [`crate::decide::deadline`]): `replay` skips the row once it has
    /// passed. `None` for a message without one.
    pub expires_at: Option<DateTime<Utc>>,
    /// Whether the row records a dispatch without a decision (Redis was unavailable and the
    /// message's rules have `on_unavailable = "allow"`): like a shadow row, a message that
    /// went out, which `replay` never takes.
    pub unchecked: bool,
}

impl DenialRow {
    /// A row for `message` denied at `denied_at`, taking the message's fields; the caller sets
    /// the refusal's (rule, kind, reason, shadow, retry_after, replay_of) with struct update
    /// syntax (and the deadline, `expires_at`); the others are their defaults (empty, false,
    /// none), so a column added to the row needs nothing here.
    pub fn for_message(message: &SendRequest, denied_at: DateTime<Utc>) -> DenialRow {
        DenialRow {
            message_id: message.id.clone(),
            recipient: message.recipient.clone(),
            channel: message.channel.clone(),
            category: message.category.clone(),
            message: message.to_json_text().into(),
            denied_at,
            ..DenialRow::default()
        }
    }
}

/// A recorded denial, as operators see it: its row, with what Postgres assigned and what
/// happened to it since. Reads as its row ([`Deref`](std::ops::Deref)); its JSON, one field
/// per column, is [`columns`]'.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Denial {
    /// Row id; also the keyset pagination cursor.
    pub id: i64,
    /// The denial as written.
    #[sqlx(flatten)]
    pub row: DenialRow,
    /// When it was replayed, if it was.
    pub replayed_at: Option<DateTime<Utc>>,
}

impl std::ops::Deref for Denial {
    type Target = DenialRow;

    fn deref(&self) -> &DenialRow {
        &self.row
    }
}

/// A stored request's JSON text, kept as text: parsed into a `serde_json::Value`, numbers
/// beyond f64 would change. Serialises as the JSON it holds.
#[derive(Debug, Clone, PartialEq, sqlx::Type)]
#[sqlx(transparent)]
pub struct StoredMessage(String);

impl Default for StoredMessage {
    /// An empty object: still JSON, as every stored request must be.
    fn default() -> StoredMessage {
        StoredMessage("{}".to_owned())
    }
}

impl StoredMessage {
    /// The JSON text.
    pub fn text(&self) -> &str {
        &self.0
    }

    /// The request parsed, for readers that want fields (numbers may round).
    pub fn value(&self) -> serde_json::Value {
        serde_json::from_str(self.text()).unwrap_or(serde_json::Value::Null)
    }
}

impl From<String> for StoredMessage {
    /// `text` must be JSON (as [`SendRequest::to_json_text`] writes): Postgres refuses a row
    /// whose request is not.
    fn from(text: String) -> StoredMessage {
        StoredMessage(text)
    }
}

impl Serialize for StoredMessage {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Written as it is (Postgres stored it as jsonb, so it is JSON): no tree is built.
        let raw: &serde_json::value::RawValue =
            serde_json::from_str(self.text()).map_err(serde::ser::Error::custom)?;
        raw.serialize(s)
    }
}

/// How to reach the database at `url` (the primary's or the read replica's) with `settings`'
/// TLS files and statement timeout.
fn connect_options(
    settings: &DatabaseSettings,
    url: &str,
) -> Result<sqlx::postgres::PgConnectOptions, DenialError> {
    let options =
        crate::base::tls::postgres_options(url).map_err(|e| DenialError::Url(e.to_string()))?;
    Ok(settings.tls.postgres(options).options([(
        "statement_timeout",
        settings.statement_timeout_ms.to_string(),
    )]))
}

/// A pool as `settings` size it, with an acquire timeout, so a dead connection cannot hold a
/// caller.
fn pool_options(settings: &DatabaseSettings) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(Duration::from_millis(settings.acquire_timeout_ms))
}

/// Handle on the denials table.
#[derive(Debug, Clone)]
pub struct DenialStore {
    pool: PgPool,
}

impl DenialStore {
    /// Opens a pool with an acquire timeout and a server-side statement timeout, so neither a
    /// dead connection nor a stuck query can hold the worker.
    pub async fn connect(settings: &DatabaseSettings) -> Result<DenialStore, DenialError> {
        let options = connect_options(settings, &settings.url)?;
        let pool = pool_options(settings).connect_with(options).await?;
        Ok(DenialStore { pool })
    }

    /// Wraps an existing pool (tests, tools).
    pub fn from_pool(pool: PgPool) -> DenialStore {
        DenialStore { pool }
    }

    /// Applies pending migrations.
    pub async fn migrate(&self) -> Result<(), DenialError> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// Records a denial; returns false when the same event (message, rule, replay) was
    /// already recorded, as when a denied message is delivered again.
    pub async fn insert(&self, row: &DenialRow) -> Result<bool, DenialError> {
        let recorded = self.insert_batch(&[row]).await?;
        Ok(recorded.first().copied().unwrap_or(false))
    }

    /// Records many denials in one transaction; for each row, whether it was new (false when
    /// the same event was recorded before, or earlier in this batch). Creates the partitions
    /// of months that have none yet.
    pub async fn insert_batch<R>(&self, rows: &[R]) -> Result<Vec<bool>, DenialError>
    where
        R: std::borrow::Borrow<DenialRow> + Sync,
    {
        match self.try_insert_batch(rows).await {
            Err(DenialError::Database(sqlx::Error::Database(e)))
                if e.code().as_deref() == Some(NO_PARTITION) =>
            {
                let months: Vec<DateTime<Utc>> =
                    rows.iter().map(|r| r.borrow().denied_at).collect();
                sqlx::query(
                    "SELECT denials_ensure_partition(m) FROM unnest($1::timestamptz[]) AS m",
                )
                .bind(months)
                .execute(&self.pool)
                .await?;
                self.try_insert_batch(rows).await
            }
            other => other,
        }
    }

    async fn try_insert_batch<R>(&self, rows: &[R]) -> Result<Vec<bool>, DenialError>
    where
        R: std::borrow::Borrow<DenialRow> + Sync,
    {
        let rows: Vec<&DenialRow> = rows.iter().map(|r| r.borrow()).collect();
        // One row per event within the batch; later copies report "already recorded".
        let keys: Vec<EventKey<'_>> = rows
            .iter()
            .map(|r| event_key(&r.recipient, &r.message_id, &r.rule, r.replay_of))
            .collect();
        let mut first = std::collections::HashMap::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            first.entry(*key).or_insert(i);
        }
        let (places, unique): (Vec<usize>, Vec<&DenialRow>) = rows
            .iter()
            .enumerate()
            .filter(|(i, _)| first.get(&keys[*i]) == Some(i))
            .map(|(i, r)| (i, *r))
            .unzip();
        // One statement, one implicit transaction. The columns borrow from the rows: nothing
        // is copied before sqlx encodes it.
        let inserted: sql::Inserted = sql::insert(&unique).fetch_one(&self.pool).await?;
        let mut new = vec![false; rows.len()];
        for n in inserted {
            // The insert numbers the batch it was given from 1.
            let place = usize::try_from(n - 1).ok().and_then(|u| places.get(u));
            if let Some(&i) = place {
                new[i] = true;
            }
        }
        Ok(new)
    }

    /// Denials matching `filter`, newest first.
    pub async fn list(&self, filter: &DenialFilter) -> Result<Vec<Denial>, DenialError> {
        Ok(filter
            .build()
            .build_query_as()
            .fetch_all(&self.pool)
            .await?)
    }

    /// The denial with row id `id`, if there is one (the console's detail page).
    pub async fn get(&self, id: i64) -> Result<Option<Denial>, DenialError> {
        let q = format!("SELECT {} FROM denials WHERE id = $1", sql::read());
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(q))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// The highest denial id so far (0 when there is none): a replay run replays only what
    /// existed when it started, never the denials its own replays produce.
    pub async fn last_id(&self) -> Result<i64, DenialError> {
        let id: Option<i64> = sqlx::query_scalar("SELECT max(id) FROM denials")
            .fetch_one(&self.pool)
            .await?;
        Ok(id.unwrap_or(0))
    }

    /// Claims up to `batch` unreplayed denials of unsent messages ([`REPLAYABLE`]) matching
    /// `filter` with an id in `after_id + 1 ..= up_to`, oldest first, skipping rows another
    /// replay holds. The rows stay locked until the claim is finished (marked replayed,
    /// committed) or dropped (rolled back, to be replayed again later). Passing the last
    /// claimed id keeps each claim from walking past rows this run already replayed.
    pub async fn claim(
        &self,
        filter: &DenialFilter,
        batch: i64,
        after_id: i64,
        up_to: i64,
    ) -> Result<Claim, DenialError> {
        let mut tx = self.pool.begin().await?;
        let mut q = sqlx::QueryBuilder::new(format!(
            "SELECT {} FROM denials WHERE {REPLAYABLE}",
            sql::read()
        ));
        filter.push_conditions(&mut q);
        q.push(" AND id > ")
            .push_bind(after_id)
            .push(" AND id <= ")
            .push_bind(up_to);
        q.push(" ORDER BY id LIMIT ")
            .push_bind(batch.max(1))
            .push(" FOR UPDATE SKIP LOCKED");
        let rows = q.build_query_as().fetch_all(&mut *tx).await?;
        Ok(Claim { tx, rows })
    }

    /// Unreplayed denials of unsent messages matching `filter`, oldest first, without claiming them
    /// (what a dry run lists).
    pub async fn replayable(
        &self,
        filter: &DenialFilter,
        limit: i64,
    ) -> Result<Vec<Denial>, DenialError> {
        let mut q = sqlx::QueryBuilder::new(format!(
            "SELECT {} FROM denials WHERE {REPLAYABLE}",
            sql::read()
        ));
        filter.push_conditions(&mut q);
        q.push(" ORDER BY id LIMIT ").push_bind(limit.max(1));
        Ok(q.build_query_as().fetch_all(&self.pool).await?)
    }

    /// How many unreplayed denials of unsent messages matching `filter` (its `live_at` aside) a replay
    /// at `now` skips because their message's deadline has passed: what a dry run reports.
    pub async fn past_deadline(
        &self,
        filter: &DenialFilter,
        now: DateTime<Utc>,
    ) -> Result<i64, DenialError> {
        let mut q =
            sqlx::QueryBuilder::new(format!("SELECT count(*) FROM denials WHERE {REPLAYABLE}"));
        let filter = DenialFilter {
            live_at: None,
            ..filter.clone()
        };
        filter.push_conditions(&mut q);
        q.push(" AND expires_at <= ").push_bind(now);
        Ok(q.build_query_scalar().fetch_one(&self.pool).await?)
    }

    /// Drops every monthly partition that ends on or before `cutoff`, and forgets the events
    /// whose rows they held; returns their names. Whole partitions go at once: no row-by-row
    /// delete, no table bloat in the history itself.
    pub async fn prune(&self, cutoff: DateTime<Utc>) -> Result<Vec<String>, DenialError> {
        let partitions: Vec<(String, DateTime<Utc>)> = sqlx::query_as(
            "SELECT c.relname::text, \
             (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''([^'']+)''\\)'))[1]::timestamptz \
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = 'denials'::regclass ORDER BY 2",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut dropped = Vec::new();
        for (name, upper) in partitions {
            if upper <= cutoff {
                let mut tx = self.pool.begin().await?;
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP TABLE \"{}\"",
                    name.replace('"', "\"\"")
                )))
                .execute(&mut *tx)
                .await?;
                sqlx::query("DELETE FROM denial_events WHERE denied_at < $1")
                    .bind(upper)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                dropped.push(name);
            }
        }
        Ok(dropped)
    }

    /// Records a quota reset about to happen, `pending`, before anything is deleted; returns
    /// the audit row's id for [`DenialStore::finish_reset`].
    pub async fn begin_reset(
        &self,
        recipient: &str,
        actor: &str,
        rules: &[String],
        at: DateTime<Utc>,
    ) -> Result<i64, DenialError> {
        Ok(sqlx::query_scalar(
            "INSERT INTO quota_resets (recipient, actor, rules, reset_at, status) \
             VALUES ($1, $2, $3, $4, 'pending') RETURNING id",
        )
        .bind(recipient)
        .bind(actor)
        .bind(rules)
        .bind(at)
        .fetch_one(&self.pool)
        .await?)
    }

    /// Marks the reset of audit row `id` done (with the keys it removed) or failed (`None`).
    pub async fn finish_reset(
        &self,
        id: i64,
        keys_removed: Option<i64>,
    ) -> Result<(), DenialError> {
        sqlx::query(
            "UPDATE quota_resets SET status = CASE WHEN $2::integer IS NULL THEN 'failed' \
             ELSE 'done' END, keys_removed = $2 WHERE id = $1",
        )
        .bind(id)
        .bind(keys_removed.map(|k| k as i32))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records that `actor` published a quarantined message again (`sendquota quarantine
    /// replay`, or the console).
    pub async fn record_quarantine_replay(
        &self,
        message_id: Option<&str>,
        reason: &str,
        actor: &str,
    ) -> Result<(), DenialError> {
        sqlx::query(
            "INSERT INTO quarantine_replays (message_id, reason, actor) VALUES ($1, $2, $3)",
        )
        .bind(message_id)
        .bind(reason)
        .bind(actor)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The pool, for tools that run their own statements.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether Postgres answers.
    pub async fn ping(&self) -> Result<(), DenialError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }
}

/// Denials claimed for replay, locked in a transaction until [`Claim::finish`].
pub struct Claim {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    rows: Vec<Denial>,
}

impl Claim {
    /// The claimed rows, oldest first.
    pub fn rows(&self) -> &[Denial] {
        &self.rows
    }

    /// Marks `ids` (published) as replayed at `at` and releases the claim.
    pub async fn finish(mut self, ids: &[i64], at: DateTime<Utc>) -> Result<(), DenialError> {
        sqlx::query("UPDATE denials SET replayed_at = $1 WHERE id = ANY($2)")
            .bind(at)
            .bind(ids)
            .execute(&mut *self.tx)
            .await?;
        self.tx.commit().await?;
        Ok(())
    }
}
