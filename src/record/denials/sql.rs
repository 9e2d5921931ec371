//! The statements over the denial columns, built from their list ([`COLUMNS`]): the one insert
//! and the column list every read selects.
//!
//! The insert is one statement: the batch's written columns as one array each, unnested
//! together (with each row's place in the batch), a claim of each row's denial event, and the
//! rows whose event was new inserted. Each array's type is written beside its placeholder,
//! from the column's, so two arrays of one type cannot trade places unnoticed: the unnest
//! names the columns in the order the arrays are bound.

use std::sync::OnceLock;

use sqlx::postgres::PgArguments;
use sqlx::Postgres;

use super::columns::{Kind, Read, Source, COLUMNS};
use super::DenialRow;

/// What the insert returns: the place in the batch (from 1) of each row it inserted, in one
/// array, so the reply is one row whatever the batch's size (reading a row costs the driver
/// more than the number in it).
pub(super) type Inserted = Vec<i64>;

/// The query of [`insert`], bound.
pub(super) type Insert<'q> = sqlx::query::QueryScalar<'q, Postgres, Inserted, PgArguments>;

/// The written columns (name and how the value is read from a row), in [`COLUMNS`]' order,
/// which is the order of the insert's arrays.
fn written() -> impl Iterator<Item = (&'static str, &'static Read<DenialRow>)> {
    COLUMNS.iter().filter_map(|c| match &c.source {
        Source::Written(read) => Some((c.name, read)),
        Source::Assigned(_) => None,
    })
}

/// The SQL type of a column of `kind`.
fn sql_type(kind: Kind) -> &'static str {
    match kind {
        Kind::Text | Kind::Request => "TEXT",
        Kind::Flag => "BOOLEAN",
        Kind::Instant => "TIMESTAMPTZ",
        Kind::Number => "BIGINT",
    }
}

/// Binds one array per written column of `rows`, in [`written`]'s order. The arrays borrow
/// from the rows: a batch copies no string before sqlx encodes it.
fn bind<'q>(mut query: Insert<'q>, rows: &[&'q DenialRow]) -> Insert<'q> {
    for (_, read) in written() {
        query = match read {
            Read::Text(f) => query.bind(rows.iter().map(|r| f(r)).collect::<Vec<_>>()),
            Read::Flag(f) => query.bind(rows.iter().map(|r| f(r)).collect::<Vec<_>>()),
            Read::Instant(f) => query.bind(rows.iter().map(|r| f(r)).collect::<Vec<_>>()),
            Read::Number(f) => query.bind(rows.iter().map(|r| f(r)).collect::<Vec<_>>()),
            Read::Request(f) => query.bind(rows.iter().map(|r| f(r).text()).collect::<Vec<_>>()),
        };
    }
    query
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
        let arrays: Vec<String> = written()
            .enumerate()
            .map(|(i, (_, read))| format!("${}::{}[]", i + 1, sql_type(read.kind())))
            .collect();
        let names: Vec<&str> = written().map(|(name, _)| name).collect();
        // A request goes into its column as jsonb (queries over it) and into `<name>_text` as
        // written (what is read back and replayed).
        let (mut targets, mut values) = (Vec::new(), Vec::new());
        for (name, read) in written() {
            targets.push(name.to_owned());
            if read.kind() == Kind::Request {
                values.push(format!("b.{name}::jsonb"));
                targets.push(format!("{name}_text"));
            }
            values.push(format!("b.{name}"));
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

/// The columns every read of a [`super::Denial`] selects: all of [`COLUMNS`]. A request is
/// read as the text the worker wrote, or, for rows from before that column, as the text of its
/// jsonb.
pub(super) fn read() -> &'static str {
    static COLUMNS_READ: OnceLock<String> = OnceLock::new();
    COLUMNS_READ.get_or_init(|| {
        let columns: Vec<String> = COLUMNS
            .iter()
            .map(|c| match &c.source {
                Source::Written(read) if read.kind() == Kind::Request => {
                    format!("COALESCE({0}_text, {0}::text) AS {0}", c.name)
                }
                _ => c.name.to_owned(),
            })
            .collect();
        columns.join(", ")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_insert_unnests_one_array_per_column_in_the_order_they_are_bound() {
        let sql = insert_sql();
        let names: Vec<&str> = written().map(|(column, _)| column).collect();
        assert!(
            sql.contains(&format!("AS t({}, n)", names.join(", "))),
            "{sql}"
        );
        assert!(sql.contains("unnest($1::TEXT[], $2::TEXT[]"), "{sql}");
        let last = written().last().map(|(_, read)| sql_type(read.kind()));
        assert!(
            sql.contains(&format!("${}::{}[])", names.len(), last.unwrap_or("?"))),
            "{sql}"
        );
        assert!(
            sql.contains("b.message::jsonb, b.message"),
            "the request in both of its columns: {sql}"
        );
    }

    #[test]
    fn every_read_selects_each_column_once_and_the_request_as_written() {
        let read = read();
        assert!(read.starts_with("id, message_id, recipient, "), "{read}");
        assert!(
            read.contains(", COALESCE(message_text, message::text) AS message"),
            "{read}"
        );
        assert_eq!(read.split(", ").count(), COLUMNS.len() + 1, "{read}");
    }
}
