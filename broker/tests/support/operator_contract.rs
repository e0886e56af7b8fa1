//! The Operator V1 contract (`tests/contract/operator-v1.yaml`, a vendored copy of unYOLO's
//! `protocol/openapi/operator-v1.yaml`; the file is JSON), and the check every body of the
//! operator listener goes through.
//!
//! Each component schema is turned into a standalone JSON Schema exactly as unYOLO's
//! `protocol/generate-artifacts.mjs` emits its `*.schema.json` artifacts (and as the contract
//! digest hashes them): the component with every `#/components/schemas/X` reference rewritten to
//! `#/$defs/X`, plus `$defs` holding the transitive closure of the components it references,
//! rewritten the same way. Validation is draft 2020-12 with `format` asserted (`date-time` must
//! be RFC 3339, as ajv-formats checks it in the OpenClaw plugin).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::OnceLock;

use serde_json::{Map, Value, json};

/// The vendored contract document, verbatim.
pub const DOCUMENT: &str = include_str!("../contract/operator-v1.yaml");

/// The prefix of a reference to a component schema inside the document.
const COMPONENT_REF: &str = "#/components/schemas/";

/// The component schemas unYOLO emits as artifacts, with their file names (the digest hashes
/// these seven).
pub const ARTIFACTS: [(&str, &str); 7] = [
    ("Decision", "decision.schema.json"),
    ("Descriptor", "discovery.schema.json"),
    ("ErrorEnvelope", "error.schema.json"),
    ("BrokerEvent", "event.schema.json"),
    ("RequestPage", "page.schema.json"),
    ("Presentation", "presentation.schema.json"),
    ("BrokerRequest", "request.schema.json"),
];

/// The `$id` base of the artifacts.
const ID_BASE: &str = "https://unyolo.io/schema/operator/v1/";

/// The parsed document.
pub fn document() -> &'static Value {
    static DOC: OnceLock<Value> = OnceLock::new();
    DOC.get_or_init(|| serde_json::from_str(DOCUMENT).expect("the vendored contract is JSON"))
}

fn components() -> &'static Map<String, Value> {
    document()["components"]["schemas"]
        .as_object()
        .expect("the contract has components.schemas")
}

/// `value` with every `$ref` to a component rewritten to `#/$defs/...`.
fn rewrite(value: &Value) -> Value {
    match value {
        Value::Array(items) => Value::Array(items.iter().map(rewrite).collect()),
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .map(|(key, child)| {
                    let child = match (key.as_str(), child) {
                        ("$ref", Value::String(target)) => {
                            Value::String(target.replace(COMPONENT_REF, "#/$defs/"))
                        }
                        _ => rewrite(child),
                    };
                    (key.clone(), child)
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

/// The names of the components `value` references directly.
fn referenced(value: &Value, names: &mut BTreeSet<String>) {
    match value {
        Value::Array(items) => items.iter().for_each(|item| referenced(item, names)),
        Value::Object(fields) => {
            for (key, child) in fields {
                match (key.as_str(), child) {
                    ("$ref", Value::String(target)) if target.starts_with(COMPONENT_REF) => {
                        names.insert(target[COMPONENT_REF.len()..].to_owned());
                    }
                    _ => referenced(child, names),
                }
            }
        }
        _ => {}
    }
}

/// The standalone schema of one component: `$schema`, `$id`, the rewritten component, and the
/// transitive `$defs` it needs (always present, `{}` when it references nothing).
pub fn component_schema(component: &str, file_name: &str) -> Value {
    let comps = components();
    let schema = comps
        .get(component)
        .unwrap_or_else(|| panic!("the contract has no component {component}"));
    let mut names = BTreeSet::new();
    referenced(schema, &mut names);
    let mut defs = BTreeMap::new();
    while let Some(name) = names.iter().find(|n| !defs.contains_key(*n)).cloned() {
        let def = comps
            .get(&name)
            .unwrap_or_else(|| panic!("{component} references a missing component {name}"));
        referenced(def, &mut names);
        defs.insert(name, rewrite(def));
    }
    let mut artifact = Map::new();
    artifact.insert(
        "$schema".into(),
        json!("https://json-schema.org/draft/2020-12/schema"),
    );
    artifact.insert("$id".into(), json!(format!("{ID_BASE}{file_name}")));
    if let Value::Object(fields) = rewrite(schema) {
        artifact.extend(fields);
    }
    artifact.insert("$defs".into(), Value::Object(defs.into_iter().collect()));
    Value::Object(artifact)
}

/// `value` as compact JSON with every object's keys sorted (recursively) and arrays kept in
/// order: the `canonicalize` + `JSON.stringify` of unYOLO's generator.
pub fn canonical_json(value: &Value) -> String {
    fn write(value: &Value, out: &mut String) {
        match value {
            Value::Object(fields) => {
                let mut keys: Vec<&String> = fields.keys().collect();
                keys.sort_unstable();
                out.push('{');
                for (i, key) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::to_string(key).expect("a key serializes"));
                    out.push(':');
                    write(&fields[key], out);
                }
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(item, out);
                }
                out.push(']');
            }
            scalar => out.push_str(&serde_json::to_string(scalar).expect("a scalar serializes")),
        }
    }
    let mut out = String::new();
    write(value, &mut out);
    out
}

/// The contract digest of the vendored document, by unYOLO's recipe (`contractDigest()` in
/// `protocol/generate-artifacts.mjs`): `sha256:` + hex SHA-256 of the canonical JSON of
/// `{"openapi": document, "schemas": {file name: artifact}}`.
pub fn recomputed_digest() -> String {
    use sha2::{Digest, Sha256};
    let schemas: Map<String, Value> = ARTIFACTS
        .iter()
        .map(|(component, file)| ((*file).to_owned(), component_schema(component, file)))
        .collect();
    let whole = json!({ "openapi": document().clone(), "schemas": schemas });
    let hash = Sha256::digest(canonical_json(&whole).as_bytes());
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn file_name_of(component: &str) -> String {
    ARTIFACTS
        .iter()
        .find(|(name, _)| *name == component)
        .map(|(_, file)| (*file).to_owned())
        .unwrap_or_else(|| format!("{}.schema.json", component.to_ascii_lowercase()))
}

fn validators() -> &'static HashMap<String, jsonschema::Validator> {
    static VALIDATORS: OnceLock<HashMap<String, jsonschema::Validator>> = OnceLock::new();
    VALIDATORS.get_or_init(|| {
        components()
            .keys()
            .map(|component| {
                let schema = component_schema(component, &file_name_of(component));
                let validator = jsonschema::draft202012::options()
                    .should_validate_formats(true)
                    .build(&schema)
                    .unwrap_or_else(|e| panic!("the contract's {component} does not compile: {e}"));
                (component.clone(), validator)
            })
            .collect()
    })
}

/// The contract's violations of `body` as `component`, one line each (empty when it conforms).
pub fn violations(component: &str, body: &Value) -> Vec<String> {
    let validator = validators()
        .get(component)
        .unwrap_or_else(|| panic!("the contract has no component {component}"));
    validator
        .iter_errors(body)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// Panics, listing every violation, unless `body` is a valid `component` of the contract
/// (`Descriptor`, `Health`, `RequestPage`, `BrokerRequest`, `BrokerEvent`, `ErrorEnvelope`, ...).
pub fn check(component: &str, body: &Value) {
    let found = violations(component, body);
    assert!(
        found.is_empty(),
        "the body is not an Operator V1 {component}:\n  {}\n{body}",
        found.join("\n  ")
    );
}
