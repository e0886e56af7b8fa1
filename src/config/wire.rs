//! The quota file's JSON wire format, read strictly.
//!
//! serde_json, asked for a map or a struct, keeps the last of two equal keys without a word, and it
//! hands `60.0`, `6e1` and integers too large for 64 bits to a visitor as the same kind of float. An
//! operator who writes an override twice, or writes `60.0`, deserves an error instead. So the bytes
//! are first read into a [`Node`] tree that keeps every key in document order (duplicates included)
//! and remembers how each number was written, and then one pass walks the tree with JSON paths and
//! applies every per-field rule of the contract. Rules across fields live in
//! [`validate`](super::validate), shared with programmatic configs.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;

use serde::Serialize;
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

use super::error::{ConfigError, Rule, join_path, nearest};
use super::validate::{check_limit, check_override_key};
use super::{ClientLimits, Config, Identity, Limits, MAX_FILE_BYTES};

/// The six top-level fields, in the order the contract lists them.
pub(crate) const TOP_LEVEL_FIELDS: [&str; 6] = [
    "requests_per_window",
    "window_seconds",
    "client_active",
    "client_pending",
    "global_active",
    "global_executing",
];

/// The optional top-level field holding the overrides.
const CLIENTS: &str = "clients";

/// The four fields of an override.
pub(crate) const OVERRIDE_FIELDS: [&str; 4] =
    ["requests_per_window", "window_seconds", "active", "pending"];

/// A JSON value as written, with object entries in document order and duplicates kept.
#[derive(Debug)]
enum Node {
    Null,
    Bool,
    /// A non-negative integer literal that fits in 64 bits.
    Unsigned(u64),
    /// A negative integer literal that fits in 64 bits.
    Negative(i64),
    /// Anything serde_json reads as a float: a fraction, an exponent, `-0`, or an integer literal
    /// too large for 64 bits.
    Float(f64),
    String(String),
    Array(Vec<Node>),
    Object(Vec<(String, Node)>),
}

impl Node {
    /// What this value is, for messages ("found an array").
    fn kind(&self) -> &'static str {
        match self {
            Node::Null => "null",
            Node::Bool => "a boolean",
            Node::Unsigned(_) | Node::Negative(_) => "an integer",
            Node::Float(_) => "a number that is not an integer literal",
            Node::String(_) => "a string",
            Node::Array(_) => "an array",
            Node::Object(_) => "an object",
        }
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Node, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Node, E> {
        Ok(Node::Bool)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Node, E> {
        Ok(Node::Unsigned(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Node, E> {
        Ok(if v < 0 {
            Node::Negative(v)
        } else {
            Node::Unsigned(v.unsigned_abs())
        })
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Node, E> {
        Ok(Node::Float(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Node, E> {
        Ok(Node::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Node, E> {
        Ok(Node::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Node>()? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value::<Node>()?;
            entries.push((key, value));
        }
        Ok(Node::Object(entries))
    }
}

/// Parses and validates a quota file. The single entry point for untrusted bytes.
pub(crate) fn parse(bytes: &[u8], identities: BTreeSet<Identity>) -> Result<Config, ConfigError> {
    if bytes.len() > MAX_FILE_BYTES {
        return Err(ConfigError::invalid(
            "",
            Rule::FileTooLarge,
            format!(
                "the file is {} bytes; a quota file may be at most {MAX_FILE_BYTES} bytes",
                bytes.len()
            ),
        ));
    }
    let root = read_tree(bytes)?;
    find_duplicate_key(&root, "")?;
    let (limits, overrides) = read_file(&root, &identities)?;
    Config::new(limits, overrides, identities)
}

/// Reads the bytes into a tree, refusing anything that is not exactly one JSON value.
fn read_tree(bytes: &[u8]) -> Result<Node, ConfigError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ConfigError::invalid(
            "",
            Rule::Syntax,
            "the file is empty; a quota file is a JSON object",
        ));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let root = Node::deserialize(&mut deserializer)
        .map_err(|e| ConfigError::invalid("", Rule::Syntax, format!("not valid JSON: {e}")))?;
    deserializer.end().map_err(|e| {
        ConfigError::invalid(
            "",
            Rule::TrailingContent,
            format!("content after the JSON object: {e}"),
        )
    })?;
    Ok(root)
}

/// Finds the first key that appears twice in one object, at any depth, in document order.
fn find_duplicate_key(node: &Node, path: &str) -> Result<(), ConfigError> {
    match node {
        Node::Object(entries) => {
            let mut seen = HashSet::with_capacity(entries.len());
            for (key, value) in entries {
                let child = join_path(path, key);
                if !seen.insert(key.as_str()) {
                    return Err(ConfigError::invalid(
                        child,
                        Rule::DuplicateKey,
                        "duplicate key: it appears more than once in the same object",
                    ));
                }
                find_duplicate_key(value, &child)?;
            }
            Ok(())
        }
        Node::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                find_duplicate_key(item, &format!("{path}[{i}]"))?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Walks the top level: every field known, every required field present, every value in range.
fn read_file(
    root: &Node,
    identities: &BTreeSet<Identity>,
) -> Result<(Limits, BTreeMap<Identity, ClientLimits>), ConfigError> {
    let entries = expect_object(root, "", "the top level of a quota file")?;
    let mut values: [Option<u32>; 6] = [None; 6];
    let mut overrides = BTreeMap::new();
    for (key, value) in entries {
        let path = join_path("", key);
        if let Some(i) = TOP_LEVEL_FIELDS.iter().position(|f| f == key) {
            values[i] = Some(read_limit(value, &path, key)?);
        } else if key == CLIENTS {
            overrides = read_clients(value, &path, identities)?;
        } else {
            return Err(unknown_field(path, key, &TOP_LEVEL_FIELDS, Some(CLIENTS)));
        }
    }
    let [
        Some(requests_per_window),
        Some(window_seconds),
        Some(client_active),
        Some(client_pending),
        Some(global_active),
        Some(global_executing),
    ] = values
    else {
        let missing = first_missing(&values, &TOP_LEVEL_FIELDS);
        return Err(ConfigError::invalid(
            join_path("", missing),
            Rule::MissingField,
            format!(
                "missing required field; the top level needs all of {}",
                TOP_LEVEL_FIELDS.join(", ")
            ),
        ));
    };
    let limits = Limits {
        requests_per_window,
        window_seconds,
        client_active,
        client_pending,
        global_active,
        global_executing,
    };
    Ok((limits, overrides))
}

/// Walks `clients`: each key a configured identity, each value a complete override.
fn read_clients(
    node: &Node,
    path: &str,
    identities: &BTreeSet<Identity>,
) -> Result<BTreeMap<Identity, ClientLimits>, ConfigError> {
    if let Node::Null = node {
        return Err(ConfigError::invalid(
            path,
            Rule::Null,
            "null is not allowed; omit clients to have no overrides",
        ));
    }
    let entries = expect_object(node, path, "clients")?;
    let mut overrides = BTreeMap::new();
    for (key, value) in entries {
        let child = join_path(path, key);
        let identity = check_override_key(key, &child, identities)?;
        let limits = read_override(value, &child)?;
        overrides.insert(identity, limits);
    }
    Ok(overrides)
}

/// Walks one override: all four fields, nothing else.
fn read_override(node: &Node, path: &str) -> Result<ClientLimits, ConfigError> {
    if let Node::Null = node {
        return Err(ConfigError::invalid(
            path,
            Rule::Null,
            "null is not allowed; remove the override to use the defaults",
        ));
    }
    let entries = expect_object(node, path, "an override")?;
    let mut values: [Option<u32>; 4] = [None; 4];
    for (key, value) in entries {
        let child = join_path(path, key);
        match OVERRIDE_FIELDS.iter().position(|f| f == key) {
            Some(i) => values[i] = Some(read_limit(value, &child, key)?),
            None => return Err(unknown_field(child, key, &OVERRIDE_FIELDS, None)),
        }
    }
    let [
        Some(requests_per_window),
        Some(window_seconds),
        Some(active),
        Some(pending),
    ] = values
    else {
        let missing = first_missing(&values, &OVERRIDE_FIELDS);
        return Err(ConfigError::invalid(
            join_path(path, missing),
            Rule::MissingField,
            format!(
                "missing required field; an override needs all of {}",
                OVERRIDE_FIELDS.join(", ")
            ),
        ));
    };
    Ok(ClientLimits {
        requests_per_window,
        window_seconds,
        active,
        pending,
    })
}

/// Reads one limit: a positive JSON integer literal within the field's bound.
fn read_limit(node: &Node, path: &str, field: &str) -> Result<u32, ConfigError> {
    match node {
        Node::Unsigned(v) => check_limit(*v, path, field),
        Node::Negative(v) => Err(ConfigError::invalid(
            path,
            Rule::Negative,
            format!("{v} is negative; limits are positive integers"),
        )),
        Node::Float(v) => Err(ConfigError::invalid(
            path,
            Rule::NotAnInteger,
            format!(
                "{v:?} is not an integer literal; write a whole number without a fraction or exponent, at most {}",
                super::validate::maximum_for(field)
            ),
        )),
        Node::String(s) => Err(ConfigError::invalid(
            path,
            Rule::NotAnInteger,
            format!("{s:?} is a string; write the number without quotes"),
        )),
        Node::Null => Err(ConfigError::invalid(
            path,
            Rule::Null,
            "null is not allowed; every limit is a positive integer",
        )),
        other => Err(ConfigError::invalid(
            path,
            Rule::NotAnInteger,
            format!("expected a positive integer, found {}", other.kind()),
        )),
    }
}

fn expect_object<'n>(
    node: &'n Node,
    path: &str,
    what: &str,
) -> Result<&'n [(String, Node)], ConfigError> {
    match node {
        Node::Object(entries) => Ok(entries),
        Node::Null => Err(ConfigError::invalid(
            path,
            Rule::Null,
            format!("null is not allowed; {what} must be a JSON object"),
        )),
        other => Err(ConfigError::invalid(
            path,
            Rule::ExpectedObject,
            format!("{what} must be a JSON object, found {}", other.kind()),
        )),
    }
}

fn first_missing<'f>(values: &[Option<u32>], fields: &[&'f str]) -> &'f str {
    values
        .iter()
        .zip(fields)
        .find(|(v, _)| v.is_none())
        .map_or("", |(_, f)| f)
}

/// An unknown-field error, suggesting the field probably meant.
fn unknown_field(path: String, key: &str, fields: &[&str], extra: Option<&str>) -> ConfigError {
    let candidates = fields.iter().copied().chain(extra);
    let hint = match nearest(key, candidates) {
        Some(field) => format!(" (did you mean {field}?)"),
        None => match key {
            "active" | "pending" if extra.is_some() => {
                format!(
                    " (the defaults are client_{key}; active and pending belong in an override)"
                )
            }
            "client_active" | "client_pending" if extra.is_none() => format!(
                " (an override uses {}; {key} is a top-level default)",
                &key["client_".len()..]
            ),
            _ => String::new(),
        },
    };
    ConfigError::invalid(
        path,
        Rule::UnknownField,
        format!(
            "unknown field{hint}; allowed: {}",
            fields
                .iter()
                .copied()
                .chain(extra)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )
}

/// The file as written by [`Config::to_json`]: fields in the contract's order.
#[derive(Serialize)]
struct FileOut<'a> {
    requests_per_window: u32,
    window_seconds: u32,
    client_active: u32,
    client_pending: u32,
    global_active: u32,
    global_executing: u32,
    clients: BTreeMap<&'a str, OverrideOut>,
}

#[derive(Serialize)]
struct OverrideOut {
    requests_per_window: u32,
    window_seconds: u32,
    active: u32,
    pending: u32,
}

/// Writes a complete quota file for `config`, pretty-printed, ending in a newline.
pub(crate) fn write(config: &Config) -> String {
    let limits = config.limits();
    let file = FileOut {
        requests_per_window: limits.requests_per_window,
        window_seconds: limits.window_seconds,
        client_active: limits.client_active,
        client_pending: limits.client_pending,
        global_active: limits.global_active,
        global_executing: limits.global_executing,
        clients: config
            .overrides()
            .iter()
            .map(|(identity, o)| {
                (
                    identity.as_str(),
                    OverrideOut {
                        requests_per_window: o.requests_per_window,
                        window_seconds: o.window_seconds,
                        active: o.active,
                        pending: o.pending,
                    },
                )
            })
            .collect(),
    };
    // Integers and string keys always serialize; there is no error to report.
    let mut text = serde_json::to_string_pretty(&file).unwrap_or_default();
    text.push('\n');
    text
}
