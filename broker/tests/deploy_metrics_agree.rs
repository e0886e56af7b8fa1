//! The dashboard and the rules speak of metrics the broker really exports: a live broker, after a
//! drill-like load, is scraped, and every metric a panel or rule names must be there with every
//! label it selects or groups by (and every label value it matches exactly).

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use support::broker::start;
use support::eventually::eventually;
use support::http::request;
use support::metrics::metric;
use support::secrets::{AGENT_SECRET, OTHER_SECRET};

/// Series Prometheus makes itself, not the broker.
const FROM_PROMETHEUS: &[&str] = &["up"];

/// Labels Prometheus adds to every scraped series (the target's).
const TARGET_LABELS: &[&str] = &["job", "instance"];

/// PromQL words that are not metric names.
const KEYWORDS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
];

/// One metric selector an expression uses: its name and its label matchers.
#[derive(Debug)]
struct Selector {
    name: String,
    /// Label → the value it must equal (`=`), or `None` for other operators.
    matchers: Vec<(String, Option<String>)>,
}

/// What one expression uses: selectors, and labels it groups or matches by.
#[derive(Debug, Default)]
struct Uses {
    selectors: Vec<Selector>,
    grouping: Vec<String>,
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn skip_spaces(chars: &[char], mut i: usize) -> usize {
    while i < chars.len() && chars[i].is_whitespace() {
        i += 1;
    }
    i
}

/// Reads a `"..."` string at `i` (a quote); returns its content and the index after it.
fn read_string(chars: &[char], i: usize) -> (String, usize) {
    let quote = chars[i];
    let mut out = String::new();
    let mut j = i + 1;
    while j < chars.len() && chars[j] != quote {
        if chars[j] == '\\' {
            j += 1;
        }
        out.push(chars[j]);
        j += 1;
    }
    (out, j + 1)
}

/// The metric selectors and grouping labels of a PromQL expression (the subset the rules and the
/// dashboard use: selectors with matchers, ranges, aggregations with `by`, vector matching).
fn uses(expr: &str) -> Uses {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = Uses::default();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = read_string(&chars, i).1;
        } else if c == '[' {
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c.is_ascii_digit() {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if is_ident_start(c) {
            let start = i;
            while i < chars.len() && is_ident(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = skip_spaces(&chars, i);
            let next_char = chars.get(next).copied();
            if matches!(word.as_str(), "by" | "without" | "on" | "ignoring") {
                // A label list in parentheses.
                let mut j = next + 1;
                let mut labels = Vec::new();
                while j < chars.len() && chars[j] != ')' {
                    let s = j;
                    while j < chars.len() && is_ident(chars[j]) {
                        j += 1;
                    }
                    if j > s {
                        labels.push(chars[s..j].iter().collect::<String>());
                    } else {
                        j += 1;
                    }
                }
                if matches!(word.as_str(), "by" | "on") {
                    out.grouping.extend(labels);
                }
                i = j + 1;
            } else if KEYWORDS.contains(&word.as_str()) || next_char == Some('(') {
                // An operator or a function call.
            } else {
                let mut matchers = Vec::new();
                if next_char == Some('{') {
                    let mut j = next + 1;
                    loop {
                        j = skip_spaces(&chars, j);
                        match chars.get(j) {
                            None | Some('}') => break,
                            Some(',') => j += 1,
                            Some(_) => {
                                let s = j;
                                while j < chars.len() && is_ident(chars[j]) {
                                    j += 1;
                                }
                                let label: String = chars[s..j].iter().collect();
                                j = skip_spaces(&chars, j);
                                let op_start = j;
                                while j < chars.len() && matches!(chars[j], '=' | '!' | '~') {
                                    j += 1;
                                }
                                let op: String = chars[op_start..j].iter().collect();
                                j = skip_spaces(&chars, j);
                                let (value, after) = read_string(&chars, j);
                                j = after;
                                matchers.push((label, (op == "=").then_some(value)));
                            }
                        }
                    }
                    i = j + 1;
                }
                out.selectors.push(Selector {
                    name: word,
                    matchers,
                });
            }
        } else {
            i += 1;
        }
    }
    out
}

/// The `expr:` values and the `record:` names of a rules file (block scalars `|` included).
fn rule_expressions(yaml: &str) -> (Vec<String>, BTreeSet<String>) {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut exprs = Vec::new();
    let mut records = BTreeSet::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if let Some(name) = trimmed.strip_prefix("- record:") {
            records.insert(name.trim().to_owned());
        }
        if let Some(rest) = trimmed.strip_prefix("expr:") {
            let rest = rest.trim();
            if rest == "|" {
                let indent = line.len() - trimmed.len();
                let mut block = String::new();
                i += 1;
                while i < lines.len() {
                    let l = lines[i];
                    let depth = l.len() - l.trim_start().len();
                    if !l.trim().is_empty() && depth <= indent {
                        break;
                    }
                    block.push_str(l.trim());
                    block.push('\n');
                    i += 1;
                }
                exprs.push(block);
                continue;
            }
            exprs.push(rest.to_owned());
        }
        i += 1;
    }
    (exprs, records)
}

/// Every `expr` of the dashboard's panel targets.
fn dashboard_expressions(json: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    for panel in json["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            out.push(target["expr"].as_str().expect("an expr").to_owned());
        }
    }
    out
}

/// Series of a Prometheus text exposition: name → the label sets seen.
fn exposition(text: &str) -> HashMap<String, Vec<BTreeMap<String, String>>> {
    let mut out: HashMap<String, Vec<BTreeMap<String, String>>> = HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (name, labels) = match line.find('{') {
            Some(brace) => {
                let end = line.rfind('}').expect("a closing brace");
                (&line[..brace], &line[brace + 1..end])
            }
            None => (line.split_whitespace().next().unwrap(), ""),
        };
        let mut set = BTreeMap::new();
        let chars: Vec<char> = labels.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let s = i;
            while i < chars.len() && chars[i] != '=' {
                i += 1;
            }
            let key: String = chars[s..i].iter().collect();
            let (value, after) = read_string(&chars, i + 1);
            set.insert(key.trim_matches(',').trim().to_owned(), value);
            i = after;
            while i < chars.len() && chars[i] == ',' {
                i += 1;
            }
        }
        out.entry(name.to_owned()).or_default().push(set);
    }
    out
}

/// What is wrong with `expr` against the scraped series (empty when nothing is).
fn disagreements(
    source: &str,
    expr: &str,
    series: &HashMap<String, Vec<BTreeMap<String, String>>>,
    records: &BTreeSet<String>,
) -> Vec<String> {
    let used = uses(expr);
    let mut problems = Vec::new();
    let mut labels_here: BTreeSet<String> = TARGET_LABELS.iter().map(|l| l.to_string()).collect();
    for selector in &used.selectors {
        let name = selector.name.as_str();
        if records.contains(name) {
            continue;
        }
        if FROM_PROMETHEUS.contains(&name) {
            continue;
        }
        let Some(sets) = series.get(name) else {
            problems.push(format!("{source}: `{name}` is not exported (in `{expr}`)"));
            continue;
        };
        labels_here.extend(sets.iter().flat_map(|s| s.keys().cloned()));
        for (label, value) in &selector.matchers {
            if TARGET_LABELS.contains(&label.as_str()) {
                continue;
            }
            let present = sets.iter().any(|s| match value {
                Some(v) => s.get(label) == Some(v),
                None => s.contains_key(label),
            });
            if !present {
                problems.push(format!(
                    "{source}: no `{name}` series has {label}{}",
                    value
                        .as_ref()
                        .map(|v| format!("=\"{v}\""))
                        .unwrap_or_default()
                ));
            }
        }
    }
    // A grouping label must come from one of the expression's own metrics (or the target); a
    // recording rule's labels are those of the metrics it is built from, checked where defined.
    let only_records = used.selectors.iter().all(|s| records.contains(&s.name));
    if !only_records {
        for label in &used.grouping {
            if !labels_here.contains(label) {
                problems.push(format!(
                    "{source}: groups by `{label}`, which none of its metrics has"
                ));
            }
        }
    }
    problems
}

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

#[test]
fn the_expression_reader_finds_selectors_matchers_and_grouping() {
    let used = uses(
        r#"sum by (job, code) (rate(admission_requests_total{result="rejected", code=~"a|b"}[5m]))
          / ignoring(code) group_left sum by (job) (rate(admission_requests_total[$__range])) > 0.25"#,
    );
    let names: Vec<&str> = used.selectors.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["admission_requests_total", "admission_requests_total"]
    );
    assert_eq!(
        used.selectors[0].matchers,
        [
            ("result".to_owned(), Some("rejected".to_owned())),
            ("code".to_owned(), None)
        ]
    );
    assert_eq!(used.grouping, ["job", "code", "job"]);
    let (exprs, records) = rule_expressions(
        "      - record: a:b\n        expr: |\n          x{y=\"z\"}\n            / w\n      - alert: A\n        expr: up == 0\n        for: 1m\n",
    );
    assert_eq!(exprs, ["x{y=\"z\"}\n/ w\n", "up == 0"]);
    assert!(records.contains("a:b"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_rules_name_is_exported_with_its_labels() {
    let dir = tempfile::tempdir().unwrap();
    let limits = r#"{"requests_per_window": 6, "window_seconds": 3600,
      "client_active": 5, "client_pending": 3, "global_active": 100, "global_executing": 2}"#;
    // A replica when redis-server is here, so the replica rules and panels are checked against a
    // real exposition too (a replica exports everything a lone broker does, and the Redis series).
    let redis = support::redis::RedisServer::start();
    let h = match &redis {
        Some(server) => {
            let mut options = unyolo_admission::ReplicaOptions::new(server.url(), "r1");
            // The whole deployment is this one replica: it admits as soon as it has registered.
            options.replicas = vec!["r1".to_owned()];
            support::broker::start_shared(
                support::broker::settings(
                    dir.path(),
                    limits,
                    unyolo_admission::StorageCaps::default(),
                ),
                options,
            )
            .await
        }
        _ => {
            eprintln!(
                "no redis-server (or built without `redis`): the admission_redis_* series are \
                 checked only where a replica runs"
            );
            start(dir.path(), limits).await
        }
    };

    // A drill-like load: approvals waiting, work executing and queued, a cancel, a denial,
    // refusals by rate and by pending limit, a stream, and reloads applied and rejected.
    let mut pending = Vec::new();
    for i in 0..3 {
        let reply = h
            .submit(
                AGENT_SECRET,
                &request(&format!("wait-{i}"), "demo.request", 0),
            )
            .await;
        assert_eq!(reply.status, 202);
        pending.push(reply.id());
    }
    let refused = h
        .submit(AGENT_SECRET, &request("wait-3", "demo.request", 0))
        .await;
    assert_eq!(refused.code(), "client_pending_limit");
    for i in 0..2 {
        let reply = h
            .submit(
                OTHER_SECRET,
                &request(&format!("run-{i}"), "demo.run", 60_000),
            )
            .await;
        assert_eq!(reply.status, 202);
    }
    assert_eq!(h.operator.approve(&pending[0]).await.status, 200);
    assert_eq!(h.operator.deny(&pending[1]).await.status, 200);
    let cancel = format!("/api/agent/v1/operations/{}/cancel", pending[2]);
    assert_eq!(h.post(&cancel, Some(AGENT_SECRET)).await.status, 200);
    let stream = h
        .send(
            "POST",
            "/api/agent/v1/streams",
            Some(AGENT_SECRET),
            Some(vec![7u8; 4096].into()),
        )
        .await;
    assert_eq!(stream.status, 201);
    for i in 0..6 {
        h.submit(
            OTHER_SECRET,
            &request(&format!("burst-{i}"), "demo.request", 0),
        )
        .await;
    }
    let file = dir.path().join("limits.json");
    std::fs::write(&file, limits).unwrap();
    h.broker.reload_from_path(&file).unwrap();
    std::fs::write(&file, "{}").unwrap();
    assert!(h.broker.reload_from_path(&file).is_err());
    assert!(
        eventually(async || h.snapshot().executing == 2).await,
        "both runs execute"
    );

    let text = h.metrics().await;
    let series = exposition(&text);
    assert!(
        text.contains(r#"admission_client_limit{client="agent",limit="pending"} 3"#),
        "{text}"
    );
    assert_eq!(metric(&text, "broker_store_ready"), Some(1));
    assert_eq!(
        metric(&text, r#"admission_limit{limit="global_executing"}"#),
        Some(2)
    );

    let rules_yaml =
        std::fs::read_to_string(repo("deploy/prometheus/admission.rules.yml")).unwrap();
    let (rule_exprs, records) = rule_expressions(&rules_yaml);
    assert!(rule_exprs.len() >= 15, "{rule_exprs:?}");
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo("deploy/grafana/admission.json")).unwrap(),
    )
    .unwrap();
    let panel_exprs = dashboard_expressions(&dashboard);
    assert!(panel_exprs.len() >= 11);

    let mut problems = Vec::new();
    let mut named = BTreeSet::new();
    for (source, exprs) in [("rules", &rule_exprs), ("dashboard", &panel_exprs)] {
        for expr in exprs {
            for selector in uses(expr).selectors {
                named.insert(selector.name);
            }
            problems.extend(
                disagreements(source, expr, &series, &records)
                    .into_iter()
                    .filter(|p| redis.is_some() || !p.contains("admission_redis_")),
            );
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // And the check does catch what is wrong.
    for wrong in [
        r#"admission_operations{state="stuck"}"#,
        r#"admission_operation{state="pending"}"#,
        r#"sum by (tenant) (admission_requests_total)"#,
        r#"admission_client_limit{region=~".+"}"#,
    ] {
        assert!(
            !disagreements("probe", wrong, &series, &records).is_empty(),
            "{wrong} passed"
        );
    }
    // Every recording rule the dashboard uses is defined, and the check saw real metrics.
    for name in named.iter().filter(|n| n.contains(':')) {
        assert!(records.contains(name), "`{name}` is not recorded");
    }
    for expected in [
        "admission_operations",
        "admission_client_operations",
        "admission_requests_total",
        "admission_client_requests_total",
        "admission_client_limit",
        "admission_limit",
        "admission_storage_bytes",
        "admission_storage_limit_bytes",
        "admission_config_reloads_total",
        "admission_fair_share_refusals_total",
        "admission_pool_holders",
        "broker_submissions_total",
        "broker_store_ready",
    ] {
        assert!(named.contains(expected), "nothing uses {expected}");
    }
    h.broker.shutdown().await;
}
