//! Where a key of a policy file is written: the line of a dotted key path
//! such as `tenant[2].quotas.max_qp`, and the key path at an offset.
//!
//! The text is parsed a second time into a tree of key spans ([`Tree`]),
//! which follows TOML exactly: `[[tenant]]` blocks, `[tenant.quotas]`
//! sub-tables, dotted keys (`rate.send = {..}`), inline tables
//! (`quotas = { max_qp = 0 }`) and multi-line arrays. Text that TOML cannot
//! parse has no tree; for it, [`key_at`] reads the table headers and
//! the keys before the offset on its line.

use std::fmt;
use std::ops::Range;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use toml::Spanned;

/// One step of a key path: a table key or an array index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Seg {
    Key(String),
    Index(usize),
}

/// A dotted key path, displayed as `tenant[2].quotas.max_qp`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct KeyPath(pub(crate) Vec<Seg>);

impl KeyPath {
    /// The path of tenant `index`.
    pub(crate) fn tenant(index: usize) -> Self {
        KeyPath(vec![Seg::Key("tenant".into()), Seg::Index(index)])
    }

    /// This path extended by `key`, which may be dotted (`rate.send`).
    pub(crate) fn key(&self, key: &str) -> Self {
        let mut path = self.clone();
        path.0
            .extend(key.split('.').map(|k| Seg::Key(k.to_owned())));
        path
    }

    /// This path extended by array index `index`.
    pub(crate) fn index(&self, index: usize) -> Self {
        let mut path = self.clone();
        path.0.push(Seg::Index(index));
        path
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) if i == 0 => write!(f, "{k}")?,
                Seg::Key(k) => write!(f, ".{k}")?,
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// A TOML value with the spans of its keys and array elements (values in
/// tables carry no span of their own: implicit tables have none).
#[derive(Debug)]
enum Node {
    Table(Vec<(Spanned<String>, Node)>),
    Array(Vec<Spanned<Node>>),
    Leaf,
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NodeVisitor;

        impl<'de> Visitor<'de> for NodeVisitor {
            type Value = Node;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any TOML value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Node, E> {
                Ok(Node::Leaf)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Node, E> {
                Ok(Node::Leaf)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Node, E> {
                Ok(Node::Leaf)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Node, E> {
                Ok(Node::Leaf)
            }
            fn visit_str<E>(self, _: &str) -> Result<Node, E> {
                Ok(Node::Leaf)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Node::Array(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
                let mut entries = Vec::new();
                while let Some(key) = map.next_key()? {
                    entries.push((key, map.next_value()?));
                }
                Ok(Node::Table(entries))
            }
        }

        deserializer.deserialize_any(NodeVisitor)
    }
}

/// The key spans of a policy text.
pub(crate) struct Tree<'a> {
    text: &'a str,
    /// `None` if the text is not TOML this module can walk (a syntax error,
    /// or a date-time somewhere): then lines come from scanning the text.
    root: Option<Node>,
}

impl<'a> Tree<'a> {
    pub(crate) fn new(text: &'a str) -> Self {
        Tree {
            text,
            root: toml::from_str(text).ok(),
        }
    }

    /// The 1-based line of byte `offset`.
    pub(crate) fn line_of(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }

    /// The line where `path` is written: its key (or array element), or, if
    /// it is not written (a default), the line of its nearest written
    /// parent. A tenant's path without a tree gives its `[[tenant]]` line.
    pub(crate) fn line(&self, path: &KeyPath) -> usize {
        match &self.root {
            Some(root) => self.line_of(span_of(root, &path.0).map_or(0, |s| s.start)),
            None => self.scan_tenant_line(path),
        }
    }

    /// The key path written at byte `offset` (e.g. where a deserialization
    /// error points): the last key or array element starting at or before
    /// it. Without a tree, the key of the offset's line.
    pub(crate) fn path_at(&self, offset: usize) -> KeyPath {
        let Some(root) = &self.root else {
            return key_at(self.text, offset);
        };
        let mut best: Option<(usize, KeyPath)> = None;
        visit(root, &mut KeyPath::default(), &mut |span, path| {
            if span.start <= offset && best.as_ref().is_none_or(|(s, _)| span.start >= *s) {
                best = Some((span.start, path.clone()));
            }
        });
        best.map(|(_, p)| p).unwrap_or_default()
    }

    /// Without a tree: the line of the `[[tenant]]` header of the tenant
    /// `path` is in (1 if none).
    fn scan_tenant_line(&self, path: &KeyPath) -> usize {
        let Some(Seg::Index(n)) = path.0.get(1) else {
            return 1;
        };
        self.text
            .lines()
            .enumerate()
            .filter(|(_, l)| header(l) == Some((true, "tenant".to_owned())))
            .nth(*n)
            .map_or(1, |(i, _)| i + 1)
    }
}

/// The span of the deepest written prefix of `path`.
fn span_of(node: &Node, path: &[Seg]) -> Option<Range<usize>> {
    let (first, rest) = path.split_first()?;
    match (node, first) {
        (Node::Table(entries), Seg::Key(k)) => {
            let (key, child) = entries.iter().find(|(key, _)| key.get_ref() == k)?;
            span_of(child, rest).or_else(|| Some(key.span()))
        }
        (Node::Array(items), Seg::Index(i)) => {
            let item = items.get(*i)?;
            span_of(item.get_ref(), rest).or_else(|| Some(item.span()))
        }
        _ => None,
    }
}

/// Calls `f` with the span and path of every key and array element.
fn visit(node: &Node, path: &mut KeyPath, f: &mut dyn FnMut(Range<usize>, &KeyPath)) {
    match node {
        Node::Table(entries) => {
            for (key, child) in entries {
                path.0.push(Seg::Key(key.get_ref().clone()));
                f(key.span(), path);
                visit(child, path, f);
                path.0.pop();
            }
        }
        Node::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                path.0.push(Seg::Index(i));
                f(item.span(), path);
                visit(item.get_ref(), path, f);
                path.0.pop();
            }
        }
        Node::Leaf => {}
    }
}

/// A line's table header: `(is_array_of_tables, dotted name)`.
fn header(line: &str) -> Option<(bool, String)> {
    let line = strip_comment(line).trim();
    let (array, inner) = if let Some(inner) = line.strip_prefix("[[") {
        (true, inner.strip_suffix("]]")?)
    } else {
        (false, line.strip_prefix('[')?.strip_suffix(']')?)
    };
    Some((array, normalize_key(inner)))
}

/// A dotted key with blanks and quotes removed: `rate . "send"` → `rate.send`.
fn normalize_key(key: &str) -> String {
    key.split('.')
        .map(|k| k.trim().trim_matches(|c| c == '"' || c == '\''))
        .collect::<Vec<_>>()
        .join(".")
}

/// The line without a trailing `# comment` (a `#` outside quotes).
fn strip_comment(line: &str) -> &str {
    let mut quote = None;
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), _) if c == q => quote = None,
            (None, '#') => return &line[..i],
            _ => {}
        }
    }
    line
}

/// For text TOML cannot parse: the key path written at byte `offset`, from
/// the table headers above it and the keys before it on its line (inline
/// tables followed: `quotas = { max_qp = ` gives `quotas.max_qp`; a line
/// without `=` gives its first word). Best effort: multi-line strings and
/// arrays are not followed.
pub(crate) fn key_at(text: &str, offset: usize) -> KeyPath {
    let offset = offset.min(text.len());
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    let table = table_before(&text[..line_start]);
    let line = strip_comment(&text[line_start..line_end]);
    let trimmed = line.trim_start();
    if trimmed.starts_with('[') {
        // A (broken) table header.
        let name = trimmed.trim_start_matches('[');
        let name = name.split(']').next().unwrap_or_default();
        return key_path(&normalize_key(name));
    }
    let upto = offset - line_start;
    let keys = keys_before(line.get(..upto.min(line.len())).unwrap_or(line));
    if !keys.is_empty() {
        return keys.iter().fold(table, |path, key| path.key(key));
    }
    let word = trimmed
        .split(|c: char| !(c.is_ascii_alphanumeric() || "_-.\"'".contains(c)))
        .next()
        .map(normalize_key)
        .unwrap_or_default();
    if word.is_empty() {
        table
    } else {
        table.key(&word)
    }
}

/// The table the text `before` ends in, from its `[table]` and
/// `[[array]]` headers.
fn table_before(before: &str) -> KeyPath {
    let mut table = KeyPath::default();
    let mut counts: Vec<(String, usize)> = Vec::new();
    for raw in before.lines() {
        let Some((array, name)) = header(raw) else {
            continue;
        };
        if array {
            let n = match counts.iter_mut().find(|(k, _)| *k == name) {
                Some((_, n)) => {
                    *n += 1;
                    *n
                }
                None => {
                    counts.push((name.clone(), 0));
                    0
                }
            };
            table = array_path(&name, &counts).index(n);
        } else {
            table = array_path(&name, &counts);
        }
    }
    table
}

/// The keys open at the end of `line` (the part of a line before an error):
/// inline tables entered and the last `key =`.
fn keys_before(line: &str) -> Vec<String> {
    let mut open: Vec<String> = Vec::new();
    let mut last: Option<String> = None;
    let mut word_start = 0;
    let mut quote = None;
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (Some(q), _) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') if last.is_some() => quote = Some(c),
            (None, '=') => {
                last = Some(normalize_key(&line[word_start..i]));
                word_start = i + 1;
            }
            (None, '{') => {
                open.extend(last.take());
                word_start = i + 1;
            }
            (None, '}') => {
                open.pop();
                last = None;
                word_start = i + 1;
            }
            (None, ',') => {
                last = None;
                word_start = i + 1;
            }
            _ => {}
        }
    }
    open.extend(last);
    open.retain(|k| !k.is_empty());
    open
}

/// The path of a dotted key written in text (no array indices).
fn key_path(key: &str) -> KeyPath {
    KeyPath::default().key(key)
}

/// The path of dotted table name `name`, where a prefix naming an array of
/// tables (`tenant` in `tenant.quotas`) means its latest element.
fn array_path(name: &str, counts: &[(String, usize)]) -> KeyPath {
    let mut path = KeyPath::default();
    let mut prefix = String::new();
    for part in name.split('.') {
        if !prefix.is_empty() {
            prefix.push('.');
        }
        prefix.push_str(part);
        path.0.push(Seg::Key(part.to_owned()));
        if prefix != name {
            if let Some((_, n)) = counts.iter().find(|(k, _)| *k == prefix) {
                path.0.push(Seg::Index(*n));
            }
        }
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# a comment
[[tenant]]
name = "blue"
reachable = ["a",
  "b"]
quotas = { max_qp = 0 }
rate.send = { ops_per_sec = 100000, ops_burst = 1000 }
rate.read.bytes_per_sec = 5

[[tenant]]
name = "green"

[tenant.quotas]
max_qp = 3
"#;

    fn path(s: &str) -> KeyPath {
        let mut p = KeyPath::default();
        for part in s.split('.') {
            match part.split_once('[') {
                Some((k, n)) => {
                    p = p.key(k);
                    p = p.index(n.trim_end_matches(']').parse().expect("index"));
                }
                None => p = p.key(part),
            }
        }
        p
    }

    #[test]
    fn lines_of_paths() {
        let tree = Tree::new(TEXT);
        assert!(tree.root.is_some());
        for (p, line) in [
            ("tenant[0]", 2),
            ("tenant[0].name", 3),
            ("tenant[0].reachable[1]", 5),
            ("tenant[0].quotas.max_qp", 6),
            ("tenant[0].quotas.max_cq", 6),
            ("tenant[0].rate.send.ops_burst", 7),
            ("tenant[0].rate.read.bytes_per_sec", 8),
            ("tenant[0].priority.weight", 2),
            ("tenant[1]", 10),
            ("tenant[1].name", 11),
            ("tenant[1].quotas", 13),
            ("tenant[1].quotas.max_qp", 14),
        ] {
            assert_eq!(tree.line(&path(p)), line, "{p}");
            assert_eq!(path(p).to_string(), p);
        }
    }

    #[test]
    fn paths_at_offsets() {
        let tree = Tree::new(TEXT);
        let at = |needle: &str| tree.path_at(TEXT.find(needle).expect("needle")).to_string();
        assert_eq!(at("\"b\""), "tenant[0].reachable[1]");
        assert_eq!(at("0 }"), "tenant[0].quotas.max_qp");
        assert_eq!(at("1000 }"), "tenant[0].rate.send.ops_burst");
        assert_eq!(at("3\n"), "tenant[1].quotas.max_qp");
    }

    #[test]
    fn scanning_unparsable_text() {
        let text = format!("{TEXT}max_cq = \nweird\n[[tenant.x\n");
        let tree = Tree::new(&text);
        assert!(tree.root.is_none());
        let at = |needle: &str| key_at(&text, text.find(needle).expect("needle")).to_string();
        assert_eq!(at(" \nweird"), "tenant[1].quotas.max_cq");
        assert_eq!(at("weird"), "tenant[1].quotas.weird");
        assert_eq!(at("1000 }"), "tenant[0].rate.send.ops_burst");
        assert_eq!(at("0 }"), "tenant[0].quotas.max_qp");
        assert_eq!(at("\"blue\""), "tenant[0].name");
        assert_eq!(at("[[tenant]]\nname = \"green"), "tenant");
        assert_eq!(at("[[tenant.x"), "tenant.x");
        assert_eq!(
            tree.path_at(text.find("weird").expect("needle"))
                .to_string(),
            "tenant[1].quotas.weird"
        );
        assert_eq!(tree.line(&path("tenant[1].name")), 10);
        assert_eq!(tree.line(&path("tenant[0].name")), 2);
    }
}
