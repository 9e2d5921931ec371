//! The denial history in the test's Postgres database: its rows, and a trigger that makes
//! Postgres refuse some of them (a denial that cannot be recorded is quarantined).

use std::collections::HashMap;

use sendquota::clock::ManualClock;
use sendquota::internals::denials::{Denial, DenialFilter, DenialStore};
use sqlx::PgPool;

use super::{local, request, TestEnv};

impl TestEnv {
    /// Makes Postgres refuse every denial row of `recipient` for its data (SQLSTATE 22023,
    /// "<recipient> refuses", through [`refuse_denials_of`]): a denied message to `recipient`
    /// is poison and goes to the quarantine queue. [`TestEnv::accept_denials_to`] undoes it.
    pub async fn refuse_denials_to(&self, recipient: &str) {
        refuse_denials_of(
            &self.pool,
            recipient,
            "22023",
            &format!("{recipient} refuses"),
        )
        .await;
    }

    /// Starts the worker (at 2026-02-02 09:00 UTC) with the denials of recipient `picky`
    /// refused ([`TestEnv::refuse_denials_to`]) and picky's day used by message `p1`, which it
    /// waits for: the next message to picky is denied, its row refused, and it is quarantined.
    /// Returns the worker's clock and the ids dispatched so far.
    pub async fn start_worker_quarantining_picky(
        &mut self,
    ) -> (ManualClock, HashMap<String, usize>) {
        self.refuse_denials_to("picky").await;
        let clock = ManualClock::new(local("UTC", "2026-02-02 09:00"));
        self.start_worker(&clock);
        let mut seen = HashMap::new();
        self.publish(&request("p1", "picky", "UTC")).await;
        assert!(self.outcome("p1", &mut seen).await, "p1 uses picky's day");
        (clock, seen)
    }

    /// Undoes [`TestEnv::refuse_denials_to`] (and [`refuse_denials_of`]): the cause of the
    /// quarantine is fixed.
    pub async fn accept_denials(&self) {
        sqlx::raw_sql("DROP TRIGGER refuse_rows ON denials")
            .execute(&self.pool)
            .await
            .expect("drop the refusing trigger");
    }

    /// Every denial row, oldest first.
    pub async fn denials(&self) -> Vec<Denial> {
        let store = DenialStore::from_pool(self.pool.clone());
        let mut rows = store
            .list(&DenialFilter {
                limit: 10_000,
                ..DenialFilter::default()
            })
            .await
            .expect("list denials");
        rows.reverse();
        rows
    }

    /// Number of denial rows in the whole history.
    pub async fn denial_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM denials")
            .fetch_one(&self.pool)
            .await
            .expect("count denials")
    }

    /// Number of denial rows for one message id.
    pub async fn denial_count(&self, message_id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM denials WHERE message_id = $1")
            .bind(message_id)
            .fetch_one(&self.pool)
            .await
            .expect("count denials")
    }
}

/// Makes Postgres refuse every denial row of a recipient matching `recipients` (a `LIKE`
/// pattern) with SQLSTATE `sqlstate` (class 22, a data error) and `message`, as it refuses data
/// it cannot hold: how tests and the trust bench make a message whose denial cannot be
/// recorded, which the worker quarantines. The worker refuses up front every payload the
/// denial history could not store, so no request body does it. `DROP TRIGGER refuse_rows ON
/// denials` fixes the cause.
pub async fn refuse_denials_of(pool: &PgPool, recipients: &str, sqlstate: &str, message: &str) {
    let quote = |s: &str| s.replace('\'', "''");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION refuse_rows() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         IF NEW.recipient LIKE '{}' THEN RAISE EXCEPTION '{}' USING ERRCODE = '{}'; \
         END IF; RETURN NEW; END $$; \
         CREATE TRIGGER refuse_rows BEFORE INSERT ON denials FOR EACH ROW \
         EXECUTE FUNCTION refuse_rows();",
        quote(recipients),
        quote(message),
        quote(sqlstate)
    )))
    .execute(pool)
    .await
    .expect("the refusing trigger");
}
