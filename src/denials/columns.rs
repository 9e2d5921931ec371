//! The columns of a denial row, listed once: the insert names each of them, and every read
//! selects them.
//!
//! The insert calls `denials_insert` (migrations/*_denial_unchecked.sql), which takes one
//! array per column. Its parameters are named in the call (`message_ids => $1, ...`) from the
//! same line of [`written!`] that binds the field, so no two arrays of one type can trade
//! places unnoticed: moving a line moves its name with it, and a line whose parameter is not
//! its field's plural fails `every_column_goes_to_the_parameter_named_for_it`.

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

/// What `denials_insert` returns for each row it inserted: its recipient, message id, rule
/// and replay_of (the event).
pub(super) type Inserted = (String, String, String, Option<i64>);

/// The query of [`insert`], bound.
pub(super) type Insert<'q> = sqlx::query::QueryAs<'q, Postgres, Inserted, PgArguments>;

/// Declares the written columns, each as `"<parameter of denials_insert>" <- <field of
/// DenialRow>`: [`WRITTEN`] lists them and [`bind`] binds one array per column, in the order
/// of the lines.
macro_rules! written {
    ($($param:literal <- $field:ident),* $(,)?) => {
        /// Every written column: the parameter of `denials_insert` it goes to, and the field
        /// (and column) of [`DenialRow`] it comes from, in the order [`bind`] binds them.
        pub(super) const WRITTEN: &[(&str, &str)] = &[$(($param, stringify!($field))),*];

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
    "message_ids" <- message_id,
    "recipients" <- recipient,
    "channels" <- channel,
    "categories" <- category,
    "rules" <- rule,
    "kinds" <- kind,
    "reasons" <- reason,
    "shadows" <- shadow,
    "retry_afters" <- retry_after,
    "messages" <- message,
    "denied_ats" <- denied_at,
    "replay_ofs" <- replay_of,
    "expires_ats" <- expires_at,
    "uncheckeds" <- unchecked,
}

/// The insert of a batch of `rows`, every parameter named.
pub(super) fn insert<'q>(rows: &[&'q DenialRow]) -> Insert<'q> {
    static SQL: OnceLock<String> = OnceLock::new();
    let sql = SQL.get_or_init(|| {
        let args: Vec<String> = WRITTEN
            .iter()
            .enumerate()
            .map(|(i, (param, _))| format!("{param} => ${}", i + 1))
            .collect();
        format!("SELECT * FROM denials_insert({})", args.join(", "))
    });
    bind(sqlx::query_as(sqlx::AssertSqlSafe(sql.as_str())), rows)
}

/// The columns every read of a [`super::Denial`] selects: the id, the written columns and
/// `replayed_at`. The request is read as the text the worker wrote, or, for rows from before
/// that column, as the text of its jsonb.
pub(super) fn read() -> &'static str {
    static COLUMNS: OnceLock<String> = OnceLock::new();
    COLUMNS.get_or_init(|| {
        let mut columns = vec!["id"];
        columns.extend(WRITTEN.iter().map(|(_, column)| match *column {
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
    fn every_column_goes_to_the_parameter_named_for_it() {
        for (param, field) in WRITTEN {
            let plural = match field.strip_suffix('y') {
                Some(stem) => format!("{stem}ies"),
                None => format!("{field}s"),
            };
            assert_eq!(*param, plural, "column {field}");
        }
    }

    #[test]
    fn the_insert_names_every_parameter_of_denials_insert() {
        let migration = include_str!("../../migrations/20261126000004_denial_unchecked.sql");
        let declared = migration
            .split("CREATE FUNCTION denials_insert(")
            .nth(1)
            .and_then(|rest| rest.split(") RETURNS").next())
            .expect("denials_insert is declared");
        let params: Vec<&str> = declared
            .lines()
            .filter_map(|line| line.split_whitespace().next())
            .collect();
        let named: Vec<&str> = WRITTEN.iter().map(|(param, _)| *param).collect();
        assert_eq!(named, params);
    }
}
