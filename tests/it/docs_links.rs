//! The documents' links resolve: every relative link in README.md and docs/*.md names a file
//! that exists, and every `#anchor` names a heading of its target as GitHub renders it.
//!
//! The README is the front door and docs/ the manual, linked to each other section by
//! section; a renamed heading or a moved file would otherwise leave readers at a dead link
//! that nothing notices. Needs no service.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The crate's root, where README.md and docs/ are.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The documents whose links are checked: README.md and every docs/*.md.
fn documents() -> Vec<PathBuf> {
    let mut docs = vec![root().join("README.md")];
    let dir = root().join("docs");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("docs entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    found.sort();
    docs.extend(found);
    docs
}

/// A document's markdown without its fenced code blocks (a `#` line or a `[x](y)` in code
/// is an example, not a heading or a link), as its paragraphs: blank lines end a paragraph,
/// and a code span never crosses one.
fn paragraphs(text: &str) -> Vec<String> {
    let mut paragraphs = Vec::new();
    let mut current = String::new();
    let mut fenced = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        if line.trim().is_empty() {
            if !current.is_empty() {
                paragraphs.push(std::mem::take(&mut current));
            }
            continue;
        }
        current.push_str(line);
        current.push('\n');
    }
    if !current.is_empty() {
        paragraphs.push(current);
    }
    paragraphs
}

/// `text` with its code spans taken out: a run of backticks opens one, the next run of the
/// same length closes it (an unclosed run is literal text, as in markdown).
fn without_code_spans(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|&&c| c == '`').count();
        let mut j = i + run;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let other = chars[j..].iter().take_while(|&&c| c == '`').count();
                if other == run {
                    close = Some(j + other);
                    break;
                }
                j += other;
            } else {
                j += 1;
            }
        }
        match close {
            Some(end) => {
                // What the span showed stays, for a heading's slug; only its delimiters go.
                out.push('\u{0}');
                out.extend(&chars[i + run..end - run]);
                out.push('\u{0}');
                i = end;
            }
            None => {
                out.extend(&chars[i..i + run]);
                i += run;
            }
        }
    }
    out
}

/// `text` with code spans blanked out entirely: what links are looked for in.
fn outside_code(text: &str) -> String {
    let marked = without_code_spans(text);
    let mut out = String::with_capacity(marked.len());
    let mut inside = false;
    for c in marked.chars() {
        if c == '\u{0}' {
            inside = !inside;
        } else if !inside {
            out.push(c);
        }
    }
    out
}

/// The anchor GitHub gives a heading whose text is `heading` (before duplicates are
/// numbered): the rendered text lowercased, every character that is not a letter, a digit,
/// `-`, `_` or a space dropped, each space turned into `-`.
fn slug(heading: &str) -> String {
    let rendered = link_texts(&without_code_spans(heading)).replace('\u{0}', "");
    rendered
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// `text` with each `[label](target)` replaced by its label, as a heading renders it.
fn link_texts(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|c| open + c) else {
            break;
        };
        let Some(end) = rest[close..].find(')').map(|e| close + e) else {
            break;
        };
        out.push_str(&rest[..open]);
        out.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// The anchors of a document: one per heading (`#` to `######` at the start of a line,
/// outside code), a heading whose slug was seen before numbered `-1`, `-2`, ... in order, as
/// GitHub does; and the `id`s and `name`s of HTML anchors.
fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut anchors = Vec::new();
    for paragraph in paragraphs(text) {
        for line in paragraph.lines() {
            let hashes = line.chars().take_while(|&c| c == '#').count();
            if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
                let heading = line[hashes..].trim().trim_end_matches('#');
                let base = slug(heading);
                let n = seen.entry(base.clone()).or_insert(0);
                anchors.push(if *n == 0 {
                    base.clone()
                } else {
                    format!("{base}-{n}")
                });
                *n += 1;
            }
            for attribute in ["id=\"", "name=\""] {
                if line.contains("<a ") {
                    anchors.extend(quoted_after(line, attribute));
                }
            }
        }
    }
    anchors
}

/// Every value of `attribute` (`src="`, `href="`, ...) in an HTML line.
fn quoted_after(line: &str, attribute: &str) -> Vec<String> {
    let mut values = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find(attribute) {
        let value = &rest[at + attribute.len()..];
        let Some(end) = value.find('"') else { break };
        values.push(value[..end].to_owned());
        rest = &value[end..];
    }
    values
}

/// The link targets of a paragraph (code spans excluded): markdown links and images
/// `[label](target "title")`, reference definitions `[label]: target`, and the `src` and
/// `href` of HTML tags.
fn targets(paragraph: &str) -> Vec<String> {
    let text = outside_code(paragraph);
    let mut targets = Vec::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let end = after
            .find(|c: char| c == ')' || c.is_whitespace())
            .unwrap_or(after.len());
        let target = after[..end].trim_start_matches('<').trim_end_matches('>');
        targets.push(target.to_owned());
        rest = &after[end..];
    }
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('[') {
            if let Some(at) = trimmed.find("]: ") {
                if let Some(target) = trimmed[at + 3..].split_whitespace().next() {
                    targets.push(target.to_owned());
                }
            }
        }
        if line.contains('<') {
            targets.extend(quoted_after(line, "src=\""));
            targets.extend(quoted_after(line, "href=\""));
        }
    }
    targets
}

/// What is wrong with `target`, linked from the document at `from`; `None` when it resolves.
/// External links (a scheme) are not followed.
fn broken(from: &Path, target: &str, cache: &mut HashMap<PathBuf, Vec<String>>) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        from.to_path_buf()
    } else {
        from.parent().expect("a document's folder").join(path)
    };
    if !file.exists() {
        return Some(format!("{} does not exist", shown(&file)));
    }
    let anchor = anchor?;
    if file.extension().is_none_or(|ext| ext != "md") {
        // Anchors into other files (a source file's line) are GitHub's to resolve.
        return None;
    }
    let known = cache.entry(file.clone()).or_insert_with(|| {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        anchors(&text)
    });
    if known.iter().any(|a| a == anchor) {
        return None;
    }
    Some(format!(
        "{} has no heading with anchor #{anchor} (its anchors: {})",
        shown(&file),
        known.join(", ")
    ))
}

/// `path` as the reader knows it: relative to the crate's root.
fn shown(path: &Path) -> String {
    let path = normalised(path);
    path.strip_prefix(root())
        .unwrap_or(&path)
        .display()
        .to_string()
}

/// `path` with its `..` and `.` resolved by name (the file may not exist).
fn normalised(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_in_the_readme_and_docs_resolves() {
    let mut cache = HashMap::new();
    let mut checked = 0;
    let mut problems = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap_or_else(|e| panic!("{doc:?}: {e}"));
        for paragraph in paragraphs(&text) {
            for target in targets(&paragraph) {
                checked += 1;
                if let Some(problem) = broken(&doc, &target, &mut cache) {
                    problems.push(format!("{}: link ({target}): {problem}", shown(&doc)));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} broken link(s) in README.md and docs/:\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
    assert!(
        checked > 50,
        "found only {checked} links: the documents link each other far more"
    );
}

#[test]
fn anchors_are_githubs_slugs_of_the_headings() {
    let text = "# Operations\n\n## Tracing (OTLP)\n\n```sh\n# a comment, not a heading\n```\n\n\
                ### Bounding the worker's memory\n\n## Digests (`on_deny = \"digest\"`, `digest_by`)\n\n\
                ## See [the rules](rules.md)\n\n## Notes\n\n## Notes\n\n## Notes\n";
    assert_eq!(
        anchors(text),
        [
            "operations",
            "tracing-otlp",
            "bounding-the-workers-memory",
            "digests-on_deny--digest-digest_by",
            "see-the-rules",
            "notes",
            "notes-1",
            "notes-2",
        ]
    );
}

#[test]
fn links_in_code_are_examples_not_links() {
    let paragraph = "See [rules](rules.md#digests) and `[not](a-link.md)`,\n\
                     ![a picture](screenshots/overview.png) and <img src=\"x.png\" width=\"2\">.";
    assert_eq!(
        targets(paragraph),
        ["rules.md#digests", "screenshots/overview.png", "x.png"]
    );
}
