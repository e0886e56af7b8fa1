//! The quota file's JSON wire format, read strictly.
//!
//! serde_json, asked for a map or a struct, keeps the last of two equal keys without a word, and it
//! hands `60.0`, `6e1` and integers too large for 64 bits to a visitor as the same kind of float. An
//! operator who writes an override twice, or writes `60.0`, deserves an error instead. So the bytes
//! are first read into a [`Node`] tree that keeps every key in document order (duplicates included)
//! and remembers how each number was written, and then one pass walks the tree with JSON paths and
//! applies every per-field rule of the contract. Rules across fields live in
//! [`validate`](super::validate), shared with programmatic configs.
//!
//! One piece past the usual size because it is one format, read and written: the tree that keeps
//! what serde_json would lose, the pass that applies each per-field rule with its JSON path, and
//! the writer whose output that pass reads back equal.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;

use serde::Serialize;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::error::{ConfigError, Rule, join_path, nearest};
use super::fair_share::{FairShare, POOL_FIELDS, Pool, PoolShare};
use super::identity::Identity;
use super::limits::{ClientLimits, Limits, MAX_FILE_BYTES};
use super::validate::{check_limit, check_override_key};

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

/// The optional top-level field holding the fair share of the global pools.
const FAIR_SHARE: &str = "fair_share";

/// The two fields of `fair_share`, one per pool.
const POOLS: [&str; 2] = [Pool::ALL[0].as_str(), Pool::ALL[1].as_str()];

/// What a quota file sets: the limits, the overrides and the fair share (if it has one).
pub(crate) type Parsed = (Limits, BTreeMap<Identity, ClientLimits>, Option<FairShare>);

/// The four fields of an override.
pub(crate) const OVERRIDE_FIELDS: [&str; 4] =
    ["requests_per_window", "window_seconds", "active", "pending"];

/// A JSON value as written, with object entries in document order and duplicates kept.
#[derive(Debug)]
enum Node {
    Null,
    Bool,
    /// A number, as its literal is written (`60`, `-0`, `6e1`, `1e400`, thirty digits): JSON's
    /// grammar, already checked, and nothing converted, so a message can quote it and no value
    /// is too large to be told apart.
    Number(String),
    String(String),
    Array(Vec<Node>),
    Object(Vec<(String, Node)>),
}

/// How deep objects and arrays may nest (a quota file nests three deep).
const MAX_DEPTH: usize = 64;

impl Node {
    /// What this value is, for messages ("found an array").
    fn kind(&self) -> &'static str {
        match self {
            Node::Null => "null",
            Node::Bool => "a boolean",
            Node::Number(_) => "a number",
            Node::String(_) => "a string",
            Node::Array(_) => "an array",
            Node::Object(_) => "an object",
        }
    }

    /// The tree of `raw`, a value whose syntax serde_json has checked. Objects and arrays are
    /// read one level at a time, their members kept as raw text and read in turn, so a number is
    /// never converted (serde_json would turn `1e400` into an error with no path, and thirty
    /// digits into a float). `path` names the value in errors.
    fn from_raw(raw: &RawValue, path: &str, depth: usize) -> Result<Node, ConfigError> {
        let text = raw.get();
        // The file's syntax is checked; what fails here is a string's content (a lone surrogate
        // escape), and a position within this value would not be the file's: the path says where.
        let unreadable = |e: serde_json::Error| {
            let message = e.to_string();
            let position = format!(" at line {} column {}", e.line(), e.column());
            let message = message.strip_suffix(&position).unwrap_or(&message);
            let detail = match lone_surrogate(text) {
                Some(escape) => format!(
                    "not valid JSON: the escape {escape} is half of a UTF-16 surrogate pair, \
                     without its other half; write the character itself, or both halves"
                ),
                None => format!("not valid JSON: {message}"),
            };
            ConfigError::invalid(path, Rule::Syntax, detail)
        };
        match text.as_bytes().first() {
            Some(b'-' | b'0'..=b'9') => Ok(Node::Number(text.to_owned())),
            Some(b'n') => Ok(Node::Null),
            Some(b't' | b'f') => Ok(Node::Bool),
            Some(b'"') => serde_json::from_str(text)
                .map(Node::String)
                .map_err(unreadable),
            Some(b'[' | b'{') if depth >= MAX_DEPTH => Err(ConfigError::invalid(
                path,
                Rule::Syntax,
                format!("nested more than {MAX_DEPTH} deep; a quota file nests three deep"),
            )),
            Some(b'[') => {
                let items: Vec<&RawValue> = serde_json::from_str(text).map_err(unreadable)?;
                let items = items
                    .into_iter()
                    .enumerate()
                    .map(|(i, item)| Node::from_raw(item, &format!("{path}[{i}]"), depth + 1))
                    .collect::<Result<_, _>>()?;
                Ok(Node::Array(items))
            }
            _ => {
                let RawEntries(entries) = serde_json::from_str(text).map_err(unreadable)?;
                let entries = entries
                    .into_iter()
                    .map(|(key, value)| {
                        let child = Node::from_raw(value, &join_path(path, &key), depth + 1)?;
                        Ok((key, child))
                    })
                    .collect::<Result<_, ConfigError>>()?;
                Ok(Node::Object(entries))
            }
        }
    }
}

/// The first `\uXXXX` escape in `text` (JSON whose syntax is checked) that is half of a UTF-16
/// surrogate pair without its other half, as written: what serde_json calls "unexpected end of
/// hex escape" (a high half) or "lone leading surrogate" (a low one).
fn lone_surrogate(text: &str) -> Option<&str> {
    let bytes = text.as_bytes();
    let unit = |at: usize| -> Option<u16> {
        let escape = bytes.get(at..at + 6)?;
        if escape[0] != b'\\' || escape[1] != b'u' {
            return None;
        }
        u16::from_str_radix(std::str::from_utf8(&escape[2..]).ok()?, 16).ok()
    };
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'\\' {
            i += 1;
            continue;
        }
        let Some(code) = unit(i) else {
            i += 2; // another escape (`\\`, `\"`, `\n`...): its character is not a backslash
            continue;
        };
        match code {
            0xD800..=0xDBFF if unit(i + 6).is_some_and(|low| (0xDC00..=0xDFFF).contains(&low)) => {
                i += 12;
            }
            0xD800..=0xDFFF => return text.get(i..i + 6),
            _ => i += 6,
        }
    }
    None
}

/// An object's members in document order, duplicates kept, each value as its raw text.
struct RawEntries<'a>(Vec<(String, &'a RawValue)>);

impl<'de: 'a, 'a> Deserialize<'de> for RawEntries<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;

        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = RawEntries<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawEntries<'de>, A::Error> {
                let mut entries = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    entries.push((key, map.next_value::<&RawValue>()?));
                }
                Ok(RawEntries(entries))
            }
        }

        deserializer.deserialize_map(EntriesVisitor)
    }
}

/// Parses a quota file and checks every per-field rule, against the configured `identities`:
/// the limits and the overrides it sets. The single entry point for untrusted bytes; the rules
/// across fields are [`Config::new`](super::Config::new)'s.
pub(crate) fn parse(bytes: &[u8], identities: &BTreeSet<Identity>) -> Result<Parsed, ConfigError> {
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
    read_file(&root, identities)
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
    encoding_problem(bytes)?;
    // The syntax of the whole file is checked here (every position in an error is the file's);
    // the tree is then read from the raw text.
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let root = <&RawValue>::deserialize(&mut deserializer)
        .map_err(|e| ConfigError::invalid("", Rule::Syntax, format!("not valid JSON: {e}")))?;
    deserializer.end().map_err(|e| {
        ConfigError::invalid(
            "",
            Rule::TrailingContent,
            format!("content after the JSON object: {e}"),
        )
    })?;
    Node::from_raw(root, "", 0)
}

/// Refuses a file that is not plain UTF-8 before the JSON reader sees it, naming what it is
/// (its error would point at an invisible mark or a stray byte): a UTF-8 byte order mark,
/// UTF-16 or UTF-32 text, or a byte that is not UTF-8, with its line and column.
fn encoding_problem(bytes: &[u8]) -> Result<(), ConfigError> {
    let fail = |detail: String| Err(ConfigError::invalid("", Rule::Syntax, detail));
    if bytes.starts_with(&[0xEF, 0xBB, 0xBF]) {
        return fail(
            "the file starts with a byte order mark (EF BB BF); save it as UTF-8 without one"
                .to_owned(),
        );
    }
    // A byte order mark, or the zero bytes of two wide ASCII characters (`{` and a newline,
    // say); a lone NUL is left to the JSON reader.
    let wide = bytes.starts_with(&[0xFF, 0xFE])
        || bytes.starts_with(&[0xFE, 0xFF])
        || (bytes.len() >= 4
            && ((bytes[1] == 0 && bytes[3] == 0) || (bytes[0] == 0 && bytes[2] == 0)));
    if wide {
        return fail("the file is UTF-16 or UTF-32 text; save it as UTF-8".to_owned());
    }
    if let Err(err) = std::str::from_utf8(bytes) {
        let at = err.valid_up_to();
        let before = &bytes[..at];
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let line_start = before
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        // Characters, as a text editor counts columns.
        let column = String::from_utf8_lossy(&before[line_start..])
            .chars()
            .count()
            + 1;
        return fail(format!(
            "the file is not UTF-8: byte 0x{:02X} at line {line} column {column}; save it as UTF-8",
            bytes[at]
        ));
    }
    Ok(())
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
fn read_file(root: &Node, identities: &BTreeSet<Identity>) -> Result<Parsed, ConfigError> {
    let entries = expect_object(root, "", "the top level of a quota file")?;
    let mut values: [Option<u32>; 6] = [None; 6];
    let mut overrides = BTreeMap::new();
    let mut fair_share = None;
    for (key, value) in entries {
        let path = join_path("", key);
        if let Some(i) = TOP_LEVEL_FIELDS.iter().position(|f| f == key) {
            values[i] = Some(read_limit(value, &path, key)?);
        } else if key == CLIENTS {
            overrides = read_clients(value, &path, identities)?;
        } else if key == FAIR_SHARE {
            fair_share = Some(read_fair_share(value, &path)?);
        } else {
            let optional = [CLIENTS, FAIR_SHARE];
            return Err(unknown_field(path, key, &TOP_LEVEL_FIELDS, &optional));
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
    Ok((limits, overrides, fair_share))
}

/// Walks `fair_share`: both pools, each with both of its fields, nothing else. The rules across
/// fields (a reserve below its pool, a floor within every client's limit) are
/// [`validate_fair_share`](super::validate::validate_fair_share)'s.
fn read_fair_share(node: &Node, path: &str) -> Result<FairShare, ConfigError> {
    if let Node::Null = node {
        return Err(ConfigError::invalid(
            path,
            Rule::Null,
            "null is not allowed; omit fair_share to serve the pools first come, first served",
        ));
    }
    let entries = expect_object(node, path, "fair_share")?;
    let mut pools: [Option<PoolShare>; 2] = [None; 2];
    for (key, value) in entries {
        let child = join_path(path, key);
        match POOLS.iter().position(|f| f == key) {
            Some(i) => pools[i] = Some(read_pool_share(value, &child)?),
            None => return Err(unknown_field(child, key, &POOLS, &[])),
        }
    }
    let [Some(active), Some(executing)] = pools else {
        let missing = POOLS[pools.iter().position(Option::is_none).unwrap_or(0)];
        return Err(ConfigError::invalid(
            join_path(path, missing),
            Rule::MissingField,
            format!(
                "missing required field; fair_share needs both pools, {}",
                POOLS.join(" and ")
            ),
        ));
    };
    Ok(FairShare { active, executing })
}

/// Walks one pool's entry of `fair_share`: `reserve` (zero allowed) and `floor`, nothing else.
fn read_pool_share(node: &Node, path: &str) -> Result<PoolShare, ConfigError> {
    if let Node::Null = node {
        return Err(ConfigError::invalid(
            path,
            Rule::Null,
            "null is not allowed; a pool's entry is a JSON object with reserve and floor",
        ));
    }
    let entries = expect_object(node, path, "a pool's entry")?;
    let mut values: [Option<u32>; 2] = [None; 2];
    for (key, value) in entries {
        let child = join_path(path, key);
        match POOL_FIELDS.iter().position(|f| f == key) {
            Some(0) => values[0] = Some(read_count(value, &child, key, Kind::Reserve)?),
            Some(i) => values[i] = Some(read_count(value, &child, key, Kind::Floor)?),
            None => return Err(unknown_field(child, key, &POOL_FIELDS, &[])),
        }
    }
    let [Some(reserve), Some(floor)] = values else {
        let missing = first_missing(&values, &POOL_FIELDS);
        return Err(ConfigError::invalid(
            join_path(path, missing),
            Rule::MissingField,
            format!(
                "missing required field; a pool's entry needs both {}",
                POOL_FIELDS.join(" and ")
            ),
        ));
    };
    Ok(PoolShare { reserve, floor })
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
            None => return Err(unknown_field(child, key, &OVERRIDE_FIELDS, &[])),
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
    read_count(node, path, field, Kind::Limit)
}

/// What a count in the file is, for what it may be and how an error says so.
#[derive(Clone, Copy)]
enum Kind {
    /// A limit: positive.
    Limit,
    /// A fair-share `reserve`: zero or more.
    Reserve,
    /// A fair-share `floor`: positive.
    Floor,
}

impl Kind {
    /// What a value of this kind is, after "expected".
    fn expected(self) -> &'static str {
        match self {
            Kind::Reserve => "zero or a positive integer",
            Kind::Limit | Kind::Floor => "a positive integer",
        }
    }

    /// The rule, as an error's last words.
    fn rule(self) -> &'static str {
        match self {
            Kind::Limit => "limits are positive integers",
            Kind::Reserve => "a reserve is zero or a positive integer",
            Kind::Floor => "a floor is a positive integer",
        }
    }
}

/// Reads a JSON integer literal within the field's bound, as `kind` allows.
fn read_count(node: &Node, path: &str, field: &str, kind: Kind) -> Result<u32, ConfigError> {
    match node {
        Node::Number(literal) => read_integer(literal, path, field, kind),
        Node::String(s) => Err(ConfigError::invalid(
            path,
            Rule::NotAnInteger,
            format!("{s:?} is a string; write the number without quotes"),
        )),
        Node::Null => Err(ConfigError::invalid(
            path,
            Rule::Null,
            match kind {
                Kind::Limit => "null is not allowed; every limit is a positive integer".to_owned(),
                _ => format!("null is not allowed; {}", kind.rule()),
            },
        )),
        other => Err(ConfigError::invalid(
            path,
            Rule::NotAnInteger,
            format!("expected {}, found {}", kind.expected(), other.kind()),
        )),
    }
}

/// Reads a number literal as a count of `kind`: an integer literal (`-0` is zero; one of any
/// length above the maximum is above it), else not an integer (`60.0`, `6e1`), quoted as written.
fn read_integer(literal: &str, path: &str, field: &str, kind: Kind) -> Result<u32, ConfigError> {
    let maximum = super::validate::maximum_for(field);
    let (negative, digits) = match literal.strip_prefix('-') {
        Some(digits) => (true, digits),
        None => (false, literal),
    };
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ConfigError::invalid(
            path,
            Rule::NotAnInteger,
            format!(
                "{literal} is not an integer literal; write a whole number without a fraction or exponent, at most {maximum}"
            ),
        ));
    }
    if digits.bytes().all(|b| b == b'0') {
        if let Kind::Reserve = kind {
            return Ok(0);
        }
        return Err(ConfigError::invalid(
            path,
            Rule::Zero,
            format!("{literal} is not allowed; {}", kind.rule()),
        ));
    }
    if negative {
        return Err(ConfigError::invalid(
            path,
            Rule::Negative,
            format!("{literal} is negative; {}", kind.rule()),
        ));
    }
    match digits.parse::<u64>() {
        Ok(value) => check_limit(value, path, field),
        Err(_) => Err(ConfigError::invalid(
            path,
            Rule::AboveMaximum,
            format!("{literal} is above the maximum {maximum}"),
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
fn unknown_field(path: String, key: &str, fields: &[&str], extra: &[&str]) -> ConfigError {
    let candidates = fields.iter().chain(extra).copied();
    let top_level = extra.contains(&CLIENTS);
    let hint = match nearest(key, candidates) {
        Some(field) => format!(" (did you mean {field}?)"),
        None => match key {
            "active" | "pending" if top_level => {
                format!(
                    " (the defaults are client_{key}; active and pending belong in an override)"
                )
            }
            "client_active" | "client_pending" if fields == &OVERRIDE_FIELDS[..] => format!(
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
                .chain(extra)
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )
}

/// The file as written by [`Config::to_json`](super::Config::to_json): fields in the contract's order.
#[derive(Serialize)]
struct FileOut<'a> {
    requests_per_window: u32,
    window_seconds: u32,
    client_active: u32,
    client_pending: u32,
    global_active: u32,
    global_executing: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    fair_share: Option<FairShareOut>,
    clients: BTreeMap<&'a str, OverrideOut>,
}

#[derive(Serialize)]
struct FairShareOut {
    active: PoolShareOut,
    executing: PoolShareOut,
}

#[derive(Serialize)]
struct PoolShareOut {
    reserve: u32,
    floor: u32,
}

impl From<PoolShare> for PoolShareOut {
    fn from(share: PoolShare) -> PoolShareOut {
        PoolShareOut {
            reserve: share.reserve,
            floor: share.floor,
        }
    }
}

#[derive(Serialize)]
struct OverrideOut {
    requests_per_window: u32,
    window_seconds: u32,
    active: u32,
    pending: u32,
}

/// Writes a complete quota file of `limits`, `overrides` and `fair_share` (left out when there is
/// none), pretty-printed, ending in a newline.
pub(crate) fn write(
    limits: &Limits,
    overrides: &BTreeMap<Identity, ClientLimits>,
    fair_share: Option<FairShare>,
) -> String {
    let file = FileOut {
        requests_per_window: limits.requests_per_window,
        window_seconds: limits.window_seconds,
        client_active: limits.client_active,
        client_pending: limits.client_pending,
        global_active: limits.global_active,
        global_executing: limits.global_executing,
        fair_share: fair_share.map(|share| FairShareOut {
            active: share.active.into(),
            executing: share.executing.into(),
        }),
        clients: overrides
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
