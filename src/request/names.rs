//! The request's text rules that more than one of its parts share: the name grammar of
//! channels, categories and attribute keys, the characters refused in ids and names, and how a
//! reason repeats a producer's value. Below both `message` and `attributes`, which use them.

use std::fmt;

/// Longest channel or category name, in characters.
pub const MAX_NAME_CHARS: usize = 64;

/// What a channel or category name is, as reasons and docs state it.
pub const NAME_GRAMMAR: &str = "a name is one or more words of letters, digits, `_` and `-` \
    joined by single dots, such as `sms` or `push.ios`";

/// How a channel or category breaks [`NAME_GRAMMAR`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameFault {
    /// A character outside the words' alphabet (a space, a topic wildcard `*` or `#`, ...).
    Character(char),
    /// A leading, trailing or doubled dot.
    EmptyWord,
}

impl fmt::Display for NameFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NameFault::Character(c) if c.is_ascii_graphic() => {
                write!(f, "holds `{c}` (U+{:04X})", u32::from(*c))
            }
            NameFault::Character(c) => write!(f, "holds U+{:04X}", u32::from(*c)),
            NameFault::EmptyWord => {
                f.write_str("has an empty word (a leading, trailing or doubled dot)")
            }
        }
    }
}

/// Why `name` is not a channel or category name ([`NAME_GRAMMAR`]), or `None` when it is one.
/// The channel is the dispatch routing key, so a name never holds a topic wildcard (`*`, `#`)
/// that would reach senders' bindings as a pattern, nor a space; the category follows the same
/// grammar, since it appears in keys, metrics and tables beside the channel.
pub fn name_fault(name: &str) -> Option<NameFault> {
    if let Some(c) = name
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Some(NameFault::Character(c));
    }
    name.split('.')
        .any(str::is_empty)
        .then_some(NameFault::EmptyWord)
}

/// Characters refused in ids, recipients, channels and categories beside control characters:
/// every character of Unicode's general category Cf (format: invisible characters such as
/// U+200B, and the bidirectional controls U+061C, U+200E, U+200F, U+202A..U+202E and
/// U+2066..U+2069, which reorder the text around them), and the line and paragraph
/// separators U+2028 and U+2029 (categories Zl, Zp), which break a line where they are shown.
/// Cf as of Unicode 15.1; the standard library has no table of categories, and this one is
/// short.
const FORMAT_RANGES: [(u32, u32); 21] = [
    (0x00AD, 0x00AD),
    (0x0600, 0x0605),
    (0x061C, 0x061C),
    (0x06DD, 0x06DD),
    (0x070F, 0x070F),
    (0x0890, 0x0891),
    (0x08E2, 0x08E2),
    (0x180E, 0x180E),
    (0x200B, 0x200F),
    (0x2028, 0x202E),
    (0x2060, 0x2064),
    (0x2066, 0x206F),
    (0xFEFF, 0xFEFF),
    (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001),
    (0xE0020, 0xE007F),
];

/// The ranges of code points refused as format characters or separators (see
/// [`FORMAT_RANGES`]), inclusive: the schema producers validate against states them too.
pub fn format_ranges() -> impl Iterator<Item = (u32, u32)> {
    FORMAT_RANGES.into_iter()
}

/// Whether `c` is refused as a format character or separator (see [`FORMAT_RANGES`]).
pub fn format_character(c: char) -> bool {
    let c = u32::from(c);
    c >= 0xAD && FORMAT_RANGES.iter().any(|&(lo, hi)| (lo..=hi).contains(&c))
}

/// What kind of refused character `c` is, for reasons.
pub fn describe(c: char) -> &'static str {
    if matches!(c, '\u{2028}' | '\u{2029}') {
        "a line or paragraph separator"
    } else {
        "an invisible formatting or bidirectional control character (Unicode category Cf)"
    }
}

/// The JSON type of a value's text (known to be JSON), for reasons.
pub fn json_type(json: &str) -> &'static str {
    match json.as_bytes().first() {
        Some(b'"') => "a string",
        Some(b'{') => "an object",
        Some(b'[') => "an array",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    }
}

/// Longest piece of a producer's value a reason repeats.
const ECHO_CHARS: usize = 40;

/// A producer's string as every reason repeats it, the one rule for all fields: cut after
/// [`ECHO_CHARS`] characters (`...` marks the cut), then quoted and escaped once as Rust
/// writes a string literal (`"`, `\`, control, format and other invisible characters as
/// escapes). One line, and the same text for the same value whichever field it came in; a
/// reason's own text never escapes it again.
pub fn echo(text: &str) -> String {
    format!("{:?}", cut(text))
}

/// `text` cut after [`ECHO_CHARS`] characters, `...` when cut: a number as a reason repeats
/// it (its characters need no escape), or a string before [`echo`] quotes it.
pub fn cut(text: &str) -> String {
    let mut out: String = text.chars().take(ECHO_CHARS).collect();
    if text.chars().nth(ECHO_CHARS).is_some() {
        out.push_str("...");
    }
    out
}
