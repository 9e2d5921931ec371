//! The columns of the denial history, listed once, in [`COLUMNS`]: each column's name, where
//! its value comes from (and so its SQL and JSON types), what the OpenAPI document says of it
//! and where the CLI and the console show it.
//!
//! Every shape of a denial is derived from the list, so none restates it: the insert and every
//! read (`sql.rs`), the JSON of `denials --format json` and `GET /v1/denials` (the list's order
//! is its fields' order), the `Denial` schema of the OpenAPI document, the CLI's table and CSV,
//! and the console's page of one denial (which lists the columns its template does not show in
//! a place of their own).

use std::borrow::Cow;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::ser::{Serialize, SerializeMap, Serializer};

use super::{Denial, DenialRow, StoredMessage};
use Read::{Flag, Instant, Number, Request, Text};
use Source::{Assigned, Written};

/// Every column of a denial, in the order of its JSON fields: what the worker writes (the
/// fields of [`DenialRow`]), and what Postgres assigns or a replay sets. One line per column
/// (rustfmt would break each over three), so the list reads as the table it is.
#[rustfmt::skip]
pub const COLUMNS: &[Column] = &[
    Column::assigned("id", Number(|d| Some(d.id))).table(0).in_template(),
    Column::written("message_id", Text(|r| &r.message_id)).csv(1).in_template(),
    Column::written("recipient", Text(|r| &r.recipient)).table(2).in_template(),
    Column::written("channel", Text(|r| &r.channel)).table(3).in_template(),
    Column::written("category", Text(|r| &r.category)).table(4).in_template(),
    Column::written("rule", Text(|r| &r.rule)).table_as(5, marked_rule).in_template(),
    Column::written("kind", Text(|r| &r.kind)).table(6).in_template(),
    Column::written("reason", Text(|r| &r.reason)).csv(0).in_template(),
    Column::written("shadow", Flag(|r| r.shadow)).in_template(),
    Column::written("unchecked", Flag(|r| r.unchecked)).in_template().about(
        "the row records a dispatch without a decision: Redis was unavailable and every rule \
         matching the message has on_unavailable = allow; replay never takes it",
    ),
    Column::written("denied_at", Instant(|r| Some(r.denied_at))).table(1).in_template(),
    Column::written("retry_after", Instant(|r| r.retry_after)).table(7).in_template(),
    Column::assigned("replayed_at", Instant(|d| d.replayed_at)).table(8).in_template(),
    Column::written("replay_of", Number(|r| r.replay_of)).in_template(),
    Column::written("expires_at", Instant(|r| r.expires_at)).nullable().in_template().about(
        "the message's deadline (its expires_at, or a delay rule's max_delay from its first \
         receipt); replay skips the denial once it has passed",
    ),
    Column::written("message", Request(|r| &r.message)).in_template(),
];

/// The CLI's rule cell: the rule, marked when the row is not a plain denial of an unsent
/// message, so a table read by people does not need the flags' columns.
fn marked_rule(d: &Denial) -> String {
    if d.shadow {
        format!("{} (shadow)", d.rule)
    } else if d.unchecked {
        format!("{} (unchecked)", d.rule)
    } else if d.reason == crate::decide::deadline::EXPIRED_REASON {
        format!("{} (expired)", d.rule)
    } else {
        d.rule.clone()
    }
}

/// One column of the denial history: everything each output needs to know of it.
pub struct Column {
    /// Its name in SQL, in the JSON, in the OpenAPI schema and in the CLI's headers.
    pub name: &'static str,
    /// Where its value comes from, and of what type.
    pub source: Source,
    /// Whether the OpenAPI document says it may be null.
    pub nullable: bool,
    /// What the OpenAPI document says of it; empty for nothing.
    pub about: &'static str,
    /// Where `denials` shows it besides its JSON.
    pub cli: Cli,
    /// How the console's page of one denial shows it.
    pub console: Console,
}

/// Where a column's value comes from.
pub enum Source {
    /// The worker writes it: a field of [`DenialRow`], one array of the insert.
    Written(Read<DenialRow>),
    /// Postgres assigns it (the id) or a later statement sets it (`replayed_at`): only read.
    Assigned(Read<Denial>),
}

/// How a column's value is read from a `T`. The variant is the value's type, which gives its
/// SQL type, its JSON type and how a cell writes it.
pub enum Read<T> {
    /// Text, never null (`TEXT`; a JSON string).
    Text(fn(&T) -> &str),
    /// Yes or no (`BOOLEAN`; a JSON boolean).
    Flag(fn(&T) -> bool),
    /// An instant, or none (`TIMESTAMPTZ`; an RFC 3339 string or null).
    Instant(fn(&T) -> Option<DateTime<Utc>>),
    /// A whole number, or none (`BIGINT`; a JSON integer or null).
    Number(fn(&T) -> Option<i64>),
    /// A stored request (`jsonb`, for queries, and its text as written in `<name>_text`; the
    /// JSON as written).
    Request(fn(&T) -> &StoredMessage),
}

/// Where the CLI's `denials` shows a column, besides `--format json` (which has them all).
pub enum Cli {
    /// Only in the JSON.
    Json,
    /// In the table and the CSV, at this place among the table's columns (from 0).
    Table(u8),
    /// As `Table`, its cell written by this function rather than from its value.
    TableAs(u8, fn(&Denial) -> String),
    /// In the CSV only, after the table's columns, at this place among those (from 0).
    Csv(u8),
}

/// How the console's page of one denial (`denial.html`) shows a column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Console {
    /// The template shows it in a place of its own.
    Template,
    /// The page lists it by name after the others, as the CLI writes its cell: a new column is
    /// on the page with no change to the template.
    Listed,
}

impl Column {
    /// A column the worker writes from `read`'s field of [`DenialRow`]; shown in the JSON and
    /// listed on the console's page until said otherwise.
    const fn written(name: &'static str, read: Read<DenialRow>) -> Column {
        Column::new(name, Written(read))
    }

    /// A column Postgres assigns, read with `read`.
    const fn assigned(name: &'static str, read: Read<Denial>) -> Column {
        Column::new(name, Assigned(read))
    }

    const fn new(name: &'static str, source: Source) -> Column {
        Column {
            name,
            source,
            nullable: false,
            about: "",
            cli: Cli::Json,
            console: Console::Listed,
        }
    }

    /// In the CLI's table and CSV, at `place` among the table's columns.
    const fn table(self, place: u8) -> Column {
        Column {
            cli: Cli::Table(place),
            ..self
        }
    }

    /// As [`Column::table`], its cell written by `cell`.
    const fn table_as(self, place: u8, cell: fn(&Denial) -> String) -> Column {
        Column {
            cli: Cli::TableAs(place, cell),
            ..self
        }
    }

    /// In the CLI's CSV only, at `place` after the table's columns.
    const fn csv(self, place: u8) -> Column {
        Column {
            cli: Cli::Csv(place),
            ..self
        }
    }

    /// Documented as nullable.
    const fn nullable(self) -> Column {
        Column {
            nullable: true,
            ..self
        }
    }

    /// Documented with `about`.
    const fn about(self, about: &'static str) -> Column {
        Column { about, ..self }
    }

    /// Shown by the console's template of one denial in a place of its own.
    const fn in_template(self) -> Column {
        Column {
            console: Console::Template,
            ..self
        }
    }

    /// Its value in `d`.
    pub fn value<'d>(&self, d: &'d Denial) -> Value<'d> {
        match &self.source {
            Written(read) => read.value(&d.row),
            Assigned(read) => read.value(d),
        }
    }

    /// Its cell in the CLI's table and CSV (and the console's list of further columns).
    pub fn cell<'d>(&self, d: &'d Denial) -> Cow<'d, str> {
        match self.cli {
            Cli::TableAs(_, cell) => Cow::Owned(cell(d)),
            _ => self.value(d).text(),
        }
    }

    /// Its type in the OpenAPI document.
    fn json_type(&self) -> &'static str {
        let kind = match &self.source {
            Written(read) => read.kind(),
            Assigned(read) => read.kind(),
        };
        match kind {
            Kind::Text | Kind::Instant => "string",
            Kind::Flag => "boolean",
            Kind::Number => "integer",
            Kind::Request => "object",
        }
    }
}

/// The type of a column's value, without how it is read: what the SQL statements and the
/// OpenAPI schema need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// [`Read::Text`].
    Text,
    /// [`Read::Flag`].
    Flag,
    /// [`Read::Instant`].
    Instant,
    /// [`Read::Number`].
    Number,
    /// [`Read::Request`].
    Request,
}

impl<T> Read<T> {
    /// The value in `of`.
    pub fn value<'a>(&self, of: &'a T) -> Value<'a> {
        match self {
            Text(f) => Value::Text(f(of)),
            Flag(f) => Value::Flag(f(of)),
            Instant(f) => Value::Instant(f(of)),
            Number(f) => Value::Number(f(of)),
            Request(f) => Value::Request(f(of)),
        }
    }

    /// The value's type.
    pub(super) fn kind(&self) -> Kind {
        match self {
            Text(_) => Kind::Text,
            Flag(_) => Kind::Flag,
            Instant(_) => Kind::Instant,
            Number(_) => Kind::Number,
            Request(_) => Kind::Request,
        }
    }
}

/// One column's value in one denial, borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    /// Text.
    Text(&'a str),
    /// Yes or no.
    Flag(bool),
    /// An instant, or none.
    Instant(Option<DateTime<Utc>>),
    /// A whole number, or none.
    Number(Option<i64>),
    /// A stored request.
    Request(&'a StoredMessage),
}

impl<'a> Value<'a> {
    /// The value as a cell writes it: an instant in RFC 3339 (as the JSON has it), none as
    /// nothing, a request as its JSON.
    pub fn text(self) -> Cow<'a, str> {
        match self {
            Value::Text(s) => Cow::Borrowed(s),
            Value::Flag(b) => Cow::Borrowed(if b { "true" } else { "false" }),
            Value::Instant(t) => t.map_or(Cow::Borrowed(""), |t| Cow::Owned(rfc3339(t))),
            Value::Number(n) => n.map_or(Cow::Borrowed(""), |n| Cow::Owned(n.to_string())),
            Value::Request(m) => Cow::Borrowed(m.text()),
        }
    }
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::AutoSi, true)
}

impl Serialize for Value<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            Value::Text(text) => s.serialize_str(text),
            Value::Flag(flag) => s.serialize_bool(flag),
            Value::Instant(t) => t.map(rfc3339).serialize(s),
            Value::Number(n) => n.serialize(s),
            Value::Request(m) => m.serialize(s),
        }
    }
}

/// A denial's JSON: a `denials --format json` line, an item of `GET /v1/denials`. One field per
/// column, in [`COLUMNS`]' order; the request is written as stored, so its payload comes back
/// as the producer wrote it.
impl Serialize for Denial {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(COLUMNS.len()))?;
        for column in COLUMNS {
            map.serialize_entry(column.name, &column.value(self))?;
        }
        map.end()
    }
}

/// The OpenAPI schema of a denial's JSON (`components.schemas.Denial`), its properties in
/// [`COLUMNS`]' order.
pub struct OpenApiSchema;

impl Serialize for OpenApiSchema {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        struct Properties;
        impl Serialize for Properties {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut map = s.serialize_map(Some(COLUMNS.len()))?;
                for column in COLUMNS {
                    map.serialize_entry(column.name, &Property(column))?;
                }
                map.end()
            }
        }
        let mut map = s.serialize_map(Some(2))?;
        map.serialize_entry("type", "object")?;
        map.serialize_entry("properties", &Properties)?;
        map.end()
    }
}

/// One column's property in [`OpenApiSchema`].
struct Property<'c>(&'c Column);

impl Serialize for Property<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let column = self.0;
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("type", column.json_type())?;
        if column.nullable {
            map.serialize_entry("nullable", &true)?;
        }
        if !column.about.is_empty() {
            map.serialize_entry("description", column.about)?;
        }
        map.end()
    }
}

/// The columns of the CLI's table, in its order.
pub fn table() -> Vec<&'static Column> {
    placed(|cli| match cli {
        Cli::Table(place) | Cli::TableAs(place, _) => Some(*place),
        _ => None,
    })
}

/// The columns of the CLI's CSV, in its order: the table's, then those of the CSV only.
pub fn csv() -> Vec<&'static Column> {
    let mut columns = table();
    columns.extend(placed(|cli| match cli {
        Cli::Csv(place) => Some(*place),
        _ => None,
    }));
    columns
}

/// The columns `place` gives a place, in its order.
fn placed(place: impl Fn(&Cli) -> Option<u8>) -> Vec<&'static Column> {
    let mut columns: Vec<(u8, &Column)> = COLUMNS
        .iter()
        .filter_map(|c| place(&c.cli).map(|p| (p, c)))
        .collect();
    columns.sort_by_key(|(place, _)| *place);
    columns.into_iter().map(|(_, c)| c).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A denial with every field set, each text telling its field.
    fn sample() -> Denial {
        let at = |s: &str| DateTime::parse_from_rfc3339(s).ok().map(|t| t.to_utc());
        Denial {
            id: 7,
            row: DenialRow {
                message_id: "m1".to_owned(),
                recipient: "alice".to_owned(),
                channel: "sms".to_owned(),
                category: "default".to_owned(),
                rule: "headline".to_owned(),
                kind: "calendar_quota".to_owned(),
                reason: "at most 1".to_owned(),
                shadow: true,
                retry_after: at("2026-05-02T00:00:00Z"),
                message: r#"{"id":"m1","n":1.50}"#.to_owned().into(),
                denied_at: at("2026-05-01T09:30:00.5Z").unwrap_or_default(),
                replay_of: Some(3),
                ..DenialRow::default()
            },
            replayed_at: None,
        }
    }

    /// The fields `GET /v1/denials` and `denials --format json` have written since the first
    /// OpenAPI document, in their order: a column added later comes after them.
    #[test]
    fn the_json_has_one_field_per_column_in_the_order_of_the_list() {
        let json = serde_json::to_string(&sample()).expect("serialises");
        let first = r#"{"id":7,"message_id":"m1","recipient":"alice","channel":"sms","category":"default","rule":"headline","kind":"calendar_quota","reason":"at most 1","shadow":true,"unchecked":false,"denied_at":"2026-05-01T09:30:00.500Z","retry_after":"2026-05-02T00:00:00Z","replayed_at":null,"replay_of":3,"expires_at":null,"message":{"id":"m1","n":1.50}"#;
        assert!(json.starts_with(first), "{json}");
        let fields: Vec<&str> = COLUMNS.iter().map(|c| c.name).collect();
        for pair in fields.windows(2) {
            let at = |name: &str| json.find(&format!("\"{name}\":"));
            assert!(at(pair[0]) < at(pair[1]), "{pair:?} in {json}");
        }
    }

    #[test]
    fn the_cli_places_are_each_taken_once_from_0() {
        for (columns, which) in [(table(), "table"), (csv(), "csv")] {
            let places: Vec<u8> = columns
                .iter()
                .map(|c| match c.cli {
                    Cli::Table(p) | Cli::TableAs(p, _) | Cli::Csv(p) => p,
                    Cli::Json => u8::MAX,
                })
                .collect();
            let tables = table().len();
            let expected: Vec<u8> = (0..columns.len())
                .map(|i| if i < tables { i } else { i - tables })
                .map(|i| u8::try_from(i).unwrap_or(u8::MAX))
                .collect();
            assert_eq!(places, expected, "{which}");
        }
    }

    #[test]
    fn the_rule_cell_says_what_kind_of_row_it_is() {
        let rule = COLUMNS
            .iter()
            .find(|c| c.name == "rule")
            .expect("a rule column");
        let mut d = sample();
        assert_eq!(rule.cell(&d), "headline (shadow)");
        d.row.shadow = false;
        assert_eq!(rule.cell(&d), "headline");
        d.row.reason = crate::decide::deadline::EXPIRED_REASON.to_owned();
        assert_eq!(rule.cell(&d), "headline (expired)");
        assert_eq!(
            rule.value(&d),
            Value::Text("headline"),
            "the JSON's is plain"
        );
    }

    /// Every field of [`DenialRow`] is a written column, so none is left out of the insert:
    /// the field names are read from the row's `Debug` output, which names each field.
    #[test]
    fn every_field_of_the_row_is_a_written_column() {
        let debug = format!("{:#?}", sample().row);
        let fields: Vec<&str> = debug
            .lines()
            .filter_map(|l| l.strip_prefix("    "))
            .filter(|l| !l.starts_with(' '))
            .filter_map(|l| l.split_once(':').map(|(name, _)| name))
            .collect();
        let mut written: Vec<&str> = COLUMNS
            .iter()
            .filter(|c| matches!(c.source, Written(_)))
            .map(|c| c.name)
            .collect();
        let mut fields = fields;
        fields.sort_unstable();
        written.sort_unstable();
        assert_eq!(fields, written);
    }
}
