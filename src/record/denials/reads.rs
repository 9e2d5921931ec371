//! Where operator reads go: the read replica of `database.read_url` when it is set, else the
//! primary of `database.url`.
//!
//! Operators list the history while workers write it; a replica takes their queries off the
//! primary. Every read-only operator path (`denials`, `digests`, `rules history`, `replay
//! --dry-run`, `GET /v1/denials`, the console's pages) asks [`Reads`], and nothing else: no
//! flag is threaded through them. Writes (the worker's rows, resets, replay marks, migrations)
//! and the reads a write depends on (replay's claim, which locks the rows it then marks) use
//! [`DenialStore`] on the primary, always.
//!
//! A replica lags behind the primary (usually by milliseconds, more under load): a replay's
//! marks or a new denial show up there a moment later. When the replica is down, reads fail
//! with an error naming `database.read_url`; they do not fall back to the primary, whose load
//! the setting was made to spare, and an operator sees at once which database is away.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::{connect_options, pool_options, Denial, DenialError, DenialFilter, DenialStore};
use crate::base::config::DatabaseSettings;

/// What failed a read: a denial store's, the rollups' or sqlx's own error.
type Cause = Box<dyn std::error::Error + Send + Sync>;

/// A read that failed, saying on which database.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// On the primary (`database.url`): no read replica is configured.
    #[error("{0}")]
    Primary(Cause),
    /// On the read replica (`database.read_url`).
    #[error("{0} (reading from the read replica, database.read_url)")]
    Replica(Cause),
}

/// The pool operator reads use, and which database it reaches. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Reads {
    store: DenialStore,
    replica: bool,
}

impl Reads {
    /// The reads of a worker whose primary is `primary`: its pool when `settings` name no read
    /// replica, else a pool of the replica's own, opened lazily, so a replica that is away
    /// fails operator reads but neither the worker's start nor its decisions.
    pub fn beside(primary: &DenialStore, settings: &DatabaseSettings) -> Result<Reads, ReadError> {
        if settings.read_url.is_empty() {
            return Ok(Reads::primary(primary.clone()));
        }
        let options = read_only(settings).map_err(|e| ReadError::Replica(e.into()))?;
        Ok(Reads::replica(DenialStore::from_pool(
            pool_options(settings).connect_lazy_with(options),
        )))
    }

    /// The reads of a command: connected now, to the replica when `settings` name one, else to
    /// the primary, so a database that is away fails the command at once, named.
    pub async fn connect(settings: &DatabaseSettings) -> Result<Reads, ReadError> {
        if settings.read_url.is_empty() {
            let store = DenialStore::connect(settings)
                .await
                .map_err(|e| ReadError::Primary(e.into()))?;
            return Ok(Reads::primary(store));
        }
        let options = read_only(settings).map_err(|e| ReadError::Replica(e.into()))?;
        let pool = pool_options(settings)
            .connect_with(options)
            .await
            .map_err(|e| ReadError::Replica(DenialError::from(e).into()))?;
        Ok(Reads::replica(DenialStore::from_pool(pool)))
    }

    /// Reads from `store`, the primary's.
    pub fn primary(store: DenialStore) -> Reads {
        Reads {
            store,
            replica: false,
        }
    }

    /// Reads from `store`, a read replica's.
    pub fn replica(store: DenialStore) -> Reads {
        Reads {
            store,
            replica: true,
        }
    }

    /// Whether reads go to the read replica.
    pub fn is_replica(&self) -> bool {
        self.replica
    }

    /// The pool, for the read-only statements of other modules (the rollups, held digests,
    /// rule changes); their failures go through [`Reads::failed`].
    pub fn pool(&self) -> &PgPool {
        self.store.pool()
    }

    /// `error`, from a statement on [`Reads::pool`], saying on which database it failed.
    pub fn failed(&self, error: impl Into<Cause>) -> ReadError {
        if self.replica {
            ReadError::Replica(error.into())
        } else {
            ReadError::Primary(error.into())
        }
    }

    /// Denials matching `filter`, newest first ([`DenialStore::list`]).
    pub async fn list(&self, filter: &DenialFilter) -> Result<Vec<Denial>, ReadError> {
        self.store.list(filter).await.map_err(|e| self.failed(e))
    }

    /// The denial with row id `id`, if there is one ([`DenialStore::get`]).
    pub async fn get(&self, id: i64) -> Result<Option<Denial>, ReadError> {
        self.store.get(id).await.map_err(|e| self.failed(e))
    }

    /// What a replay would take, without claiming it ([`DenialStore::replayable`]): a dry
    /// run's listing, which a replica may show a moment behind.
    pub async fn replayable(
        &self,
        filter: &DenialFilter,
        limit: i64,
    ) -> Result<Vec<Denial>, ReadError> {
        let rows = self.store.replayable(filter, limit).await;
        rows.map_err(|e| self.failed(e))
    }

    /// How many a replay at `now` would skip for their deadline ([`DenialStore::past_deadline`]).
    pub async fn past_deadline(
        &self,
        filter: &DenialFilter,
        now: DateTime<Utc>,
    ) -> Result<i64, ReadError> {
        let count = self.store.past_deadline(filter, now).await;
        count.map_err(|e| self.failed(e))
    }
}

/// The replica's connect options: `read_url`'s, in read-only transactions, so that even a
/// `read_url` naming a primary by mistake can take no write.
fn read_only(settings: &DatabaseSettings) -> Result<sqlx::postgres::PgConnectOptions, DenialError> {
    let options = connect_options(settings, &settings.read_url)?;
    Ok(options.options([("default_transaction_read_only", "on")]))
}
