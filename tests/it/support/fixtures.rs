//! The policies tests run under, one file each in tests/fixtures/policies, named for what they
//! hold (as tests/fixtures/config holds the refused configurations, one file each).
//!
//! `policy!("name")` is the text of `tests/fixtures/policies/name.toml`, read at compile time (a
//! missing file fails the build). A fixture that one test needs with several values holds
//! placeholders, a name in braces such as `{zone}` (TOML's own inline tables always have a space
//! or `=` inside their braces), and `policy!("name", zone = "UTC", limit = 3)` fills them in
//! with [`fill`]: every value given must have its placeholder, and every placeholder a value.
//!
//! Policies that property tests generate from a model stay in the tests: they are not fixtures.

/// The text of `tests/fixtures/policies/<name>.toml`, or with `key = value` pairs its
/// placeholders `{key}` filled in (see the module's documentation).
#[allow(unused_macros)] // The benches, which include this harness, read no fixture.
macro_rules! policy {
    ($name:literal) => {
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/policies/",
            $name,
            ".toml"
        ))
    };
    ($name:literal, $($key:ident = $value:expr),+ $(,)?) => {
        $crate::support::fixtures::fill(
            $name,
            $crate::support::fixtures::policy!($name),
            &[$((stringify!($key), $value.to_string())),+],
        )
    };
}
#[allow(unused_imports)]
pub(crate) use policy;

/// `text` (fixture `name`) with each `{key}` replaced by its value; panics on a value without
/// its placeholder or a placeholder without a value.
pub fn fill(name: &str, text: &str, values: &[(&str, String)]) -> String {
    for placeholder in placeholders(text) {
        assert!(
            values
                .iter()
                .any(|(key, _)| placeholder == format!("{{{key}}}")),
            "policy fixture {name}: no value for {placeholder}"
        );
    }
    let mut filled = text.to_owned();
    for (key, value) in values {
        let placeholder = format!("{{{key}}}");
        assert!(
            text.contains(&placeholder),
            "policy fixture {name} has no placeholder {placeholder}"
        );
        filled = filled.replace(&placeholder, value);
    }
    filled
}

/// The placeholders in `text`: `{` and `}` around a name of letters, digits and `_`.
fn placeholders(text: &str) -> impl Iterator<Item = &str> {
    text.match_indices('{').filter_map(move |(open, _)| {
        let rest = &text[open + 1..];
        let len = rest.find('}')?;
        let name = &rest[..len];
        let is_name =
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        is_name.then(|| &text[open..open + len + 2])
    })
}
