//! The admin API's OpenAPI document, as served at `/openapi.json`: `openapi.json` with its
//! `Denial` schema built from the denial columns ([`columns::COLUMNS`]), so that the schema of
//! `GET /v1/denials` cannot say other than what the API writes.
//!
//! The file holds the whole document as served, for people and tools reading the source: a
//! test checks that it is what [`document`] builds, and writes it when asked to
//! (`SENDQUOTA_WRITE_OPENAPI=1`), so a new column is never written into it by hand.

use std::fmt;
use std::sync::OnceLock;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, Serializer};

use crate::record::denials::columns;

/// The document as committed in `openapi.json`; [`document`] equals it (a test checks).
pub const FILE: &str = include_str!("openapi.json");

/// Where the `Denial` schema is in the document.
const DENIAL_SCHEMA: [&str; 3] = ["components", "schemas", "Denial"];

/// The document served at `/openapi.json`: [`FILE`] with the `Denial` schema built from the
/// denial columns, written as the file is (two spaces per level, members in their order).
pub fn document() -> &'static str {
    static DOCUMENT: OnceLock<String> = OnceLock::new();
    DOCUMENT.get_or_init(|| {
        // The file is compiled in, and a test builds the document from it: neither step can
        // fail on a binary that passed its tests.
        build(FILE).expect("openapi.json is a JSON object with components.schemas")
    })
}

/// `file` with its `Denial` schema built from the columns.
fn build(file: &str) -> Result<String, serde_json::Error> {
    let mut doc: Ordered = serde_json::from_str(file)?;
    let schema: Ordered = serde_json::from_str(&serde_json::to_string(&columns::OpenApiSchema)?)?;
    let Some(slot) = doc.member(&DENIAL_SCHEMA) else {
        return Err(serde::de::Error::custom("no components.schemas.Denial"));
    };
    *slot = schema;
    Ok(serde_json::to_string_pretty(&doc)? + "\n")
}

/// A JSON value whose objects keep their members in the order written: serde_json's `Value`
/// sorts them (its `preserve_order` feature is off), and the document's order is the one
/// people read (a schema's properties in its fields' order).
enum Ordered {
    Object(Vec<(String, Ordered)>),
    Array(Vec<Ordered>),
    Scalar(serde_json::Value),
}

impl Ordered {
    /// The member at `path`, object within object.
    fn member(&mut self, path: &[&str]) -> Option<&mut Ordered> {
        let Some((first, rest)) = path.split_first() else {
            return Some(self);
        };
        let Ordered::Object(members) = self else {
            return None;
        };
        let (_, value) = members.iter_mut().find(|(name, _)| name == first)?;
        value.member(rest)
    }
}

impl Serialize for Ordered {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Ordered::Object(members) => s.collect_map(members.iter().map(|(k, v)| (k, v))),
            Ordered::Array(items) => s.collect_seq(items),
            Ordered::Scalar(value) => value.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Ordered {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Ordered, D::Error> {
        d.deserialize_any(OrderedVisitor)
    }
}

/// Reads an [`Ordered`]: objects and arrays as they come, anything else as a `Value`.
struct OrderedVisitor;

impl<'de> Visitor<'de> for OrderedVisitor {
    type Value = Ordered;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JSON")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Ordered, A::Error> {
        let mut members = Vec::new();
        while let Some(member) = map.next_entry()? {
            members.push(member);
        }
        Ok(Ordered::Object(members))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Ordered, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Ordered::Array(items))
    }

    fn visit_bool<E>(self, v: bool) -> Result<Ordered, E> {
        Ok(Ordered::Scalar(v.into()))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Ordered, E> {
        Ok(Ordered::Scalar(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Ordered, E> {
        Ok(Ordered::Scalar(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Ordered, E> {
        Ok(Ordered::Scalar(v.into()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Ordered, E> {
        Ok(Ordered::Scalar(v.into()))
    }

    fn visit_unit<E>(self) -> Result<Ordered, E> {
        Ok(Ordered::Scalar(serde_json::Value::Null))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `openapi.json` is the document served: on a difference (a column added, say), the test
    /// writes the built document to the file when `SENDQUOTA_WRITE_OPENAPI` is set, and fails
    /// otherwise.
    #[test]
    fn the_committed_document_is_the_one_served() {
        let built = build(FILE).expect("builds");
        if built != FILE && std::env::var_os("SENDQUOTA_WRITE_OPENAPI").is_some() {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/src/ops/openapi.json");
            std::fs::write(path, &built).expect("write openapi.json");
            return;
        }
        assert!(
            built == FILE,
            "src/ops/openapi.json is not the document served (its Denial schema is built from \
             src/record/denials/columns.rs): write it with \
             `SENDQUOTA_WRITE_OPENAPI=1 cargo test --lib openapi`"
        );
    }

    #[test]
    fn the_denial_schema_lists_the_columns_in_their_order() {
        let mut doc: Ordered = serde_json::from_str(document()).expect("JSON");
        let Some(Ordered::Object(schema)) = doc.member(&DENIAL_SCHEMA) else {
            panic!("a Denial schema");
        };
        let Some((_, Ordered::Object(properties))) =
            schema.iter().find(|(name, _)| name == "properties")
        else {
            panic!("its properties");
        };
        let names: Vec<&str> = properties.iter().map(|(name, _)| name.as_str()).collect();
        let columns: Vec<&str> = columns::COLUMNS.iter().map(|c| c.name).collect();
        assert_eq!(names, columns);
    }
}
