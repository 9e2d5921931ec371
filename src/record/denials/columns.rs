//! The columns of a denial row, listed once: the insert names each of them, and every read
//! selects them.
//!
//! The insert is one statement built from the same list ([`written!`]): the batch's columns
//! as one array each, unnested together (with each row's place in the batch), a claim of each
//! row's denial event, and the rows whose event was new inserted. A column is added by a
//! migration that adds it to the table and one line here: nothing else restates the list.
//! Each array's type is written beside its column, so two arrays of one type cannot trade
//! places unnoticed: the unnest names the columns in the order the arrays are bound.

use std::sync::OnceLock;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgArguments;
use sqlx::Postgres;

use super::{DenialRow, StoredMessage};

/// One cell of a column as bound, borrowed from its row: the arrays sqlx encodes are built of
/// these, so a batch copies no string before it is encoded.
trait Cell {
    type Bound<'r>
    where
        Self: 'r;
    fn bound(&self) -> Self::Bound<'_>;
}

impl Cell for String {
    type Bound<'r> = &'r str;
    fn bound(&self) -> &str {
        self
    }
}

impl Cell for StoredMessage {
    type Bound<'r> = &'r str;
    fn bound(&self) -> &str {
        self.text()
    }
}

impl Cell for bool {
    type Bound<'r> = bool;
    fn bound(&self) -> bool {
        *self
    }
}

impl Cell for DateTime<Utc> {
    type Bound<'r> = DateTime<Utc>;
    fn bound(&self) -> DateTime<Utc> {
        *self
    }
}

impl Cell for Option<DateTime<Utc>> {
    type Bound<'r> = Option<DateTime<Utc>>;
    fn bound(&self) -> Option<DateTime<Utc>> {
        *self
    }
}

impl Cell for Option<i64> {
    type Bound<'r> = Option<i64>;
    fn bound(&self) -> Option<i64> {
        *self
    }
}

/// What the insert returns: the place in the batch (from 1) of each row it inserted, in one
/// array, so the reply is one row whatever the batch's size (reading a row costs the driver
/// more than the number in it).
pub(super) type Inserted = Vec<i64>;

/// The query of [`insert`], bound.
pub(super) type Insert<'q> = sqlx::query::QueryScalar<'q, Postgres, Inserted, PgArguments>;

/// Declares the written columns, each as `<field of DenialRow> : "<its SQL type>"`: [`WRITTEN`]
/// lists them and [`bind`] binds one array per column, in the order of the lines.
macro_rules! written {
    ($($field:ident : $sql_type:literal),* $(,)?) => {
        /// Every written column (the field of [`DenialRow`] it comes from) and its SQL type,
        /// in the order [`bind`] binds them.
        pub(super) const WRITTEN: &[(&str, &str)] = &[$((stringify!($field), $sql_type)),*];

        /// Binds one array per column of `rows`, in [`WRITTEN`]'s order.
        fn bind<'q>(query: Insert<'q>, rows: &[&'q DenialRow]) -> Insert<'q> {
            query
                $(.bind(rows.iter().map(|r| r.$field.bound()).collect::<Vec<_>>()))*
        }

        /// Never called: it compiles only while every field of [`DenialRow`] is listed, so
        /// a field added to the row and not written does not compile.
        #[allow(dead_code)]
        fn every_field_is_written(row: &DenialRow) {
            let DenialRow { $($field: _),* } = row;
        }
    };
}

written! {
    message_id: "TEXT",
    recipient: "TEXT",
    channel: "TEXT",
    category: "TEXT",
    rule: "TEXT",
    kind: "TEXT",
    reason: "TEXT",
    shadow: "BOOLEAN",
    retry_after: "TIMESTAMPTZ",
    message: "TEXT",
    denied_at: "TIMESTAMPTZ",
    replay_of: "BIGINT",
    expires_at: "TIMESTAMPTZ",
    unchecked: "BOOLEAN",
}

/// The insert of a batch of `rows` (see migrations/*_denial_events.sql for why events are
/// claimed first): one statement, so one implicit transaction. It returns the place in the
/// batch of each row inserted; a row whose event was recorded before is not.
pub(super) fn insert<'q>(rows: &[&'q DenialRow]) -> Insert<'q> {
    bind(sqlx::query_scalar(sqlx::AssertSqlSafe(insert_sql())), rows)
}

/// The statement of [`insert`], built once.
fn insert_sql() -> &'static str {
    static SQL: OnceLock<String> = OnceLock::new();
    SQL.get_or_init(|| {
        let arrays: Vec<String> = WRITTEN
            .iter()
            .enumerate()
            .map(|(i, (_, sql_type))| format!("${}::{sql_type}[]", i + 1))
            .collect();
        let names: Vec<&str> = WRITTEN.iter().map(|(column, _)| *column).collect();
        // The request goes into `message` as jsonb (queries over it) and `message_text` as
        // written (what is read back and replayed).
        let (mut targets, mut values) = (Vec::new(), Vec::new());
        for column in &names {
            targets.push(*column);
            if *column == "message" {
                values.push("b.message::jsonb".to_owned());
                targets.push("message_text");
            }
            values.push(format!("b.{column}"));
        }
        format!(
            "WITH batch AS (SELECT * FROM unnest({arrays}) WITH ORDINALITY AS t({names}, n)), \
             claimed AS (INSERT INTO denial_events (recipient, message_id, rule, replay_of, \
             denied_at) SELECT recipient, message_id, rule, COALESCE(replay_of, 0), denied_at \
             FROM batch ORDER BY 1, 2, 3, 4 ON CONFLICT DO NOTHING \
             RETURNING recipient, message_id, rule, replay_of), \
             inserted AS (INSERT INTO denials ({targets}) SELECT {values} FROM batch b \
             JOIN claimed c USING (recipient, message_id, rule) \
             WHERE c.replay_of = COALESCE(b.replay_of, 0)) \
             SELECT COALESCE(array_agg(b.n), '{{}}') FROM batch b \
             JOIN claimed c USING (recipient, message_id, rule) \
             WHERE c.replay_of = COALESCE(b.replay_of, 0)",
            arrays = arrays.join(", "),
            names = names.join(", "),
            targets = targets.join(", "),
            values = values.join(", "),
        )
    })
}

/// The columns every read of a [`super::Denial`] selects: the id, the written columns and
/// `replayed_at`. The request is read as the text the worker wrote, or, for rows from before
/// that column, as the text of its jsonb.
pub(super) fn read() -> &'static str {
    static COLUMNS: OnceLock<String> = OnceLock::new();
    COLUMNS.get_or_init(|| {
        let mut columns = vec!["id"];
        columns.extend(WRITTEN.iter().map(|(column, _)| match *column {
            "message" => "COALESCE(message_text, message::text) AS message",
            column => column,
        }));
        columns.push("replayed_at");
        columns.join(", ")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_insert_unnests_one_array_per_column_in_the_order_they_are_bound() {
        let sql = insert_sql();
        let names: Vec<&str> = WRITTEN.iter().map(|(column, _)| *column).collect();
        assert!(
            sql.contains(&format!("AS t({}, n)", names.join(", "))),
            "{sql}"
        );
        assert!(sql.contains("unnest($1::TEXT[], $2::TEXT[]"), "{sql}");
        assert!(
            sql.contains(&format!("${}::BOOLEAN[])", WRITTEN.len())),
            "{sql}"
        );
    }
}
