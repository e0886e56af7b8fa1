//! The pages a reader follows hold together: every relative link in the READMEs (the front door,
//! each crate's), `docs/`, `broker/docs/`, `CHANGELOG.md` and `BENCHMARKS.md` names a file that
//! exists (and, into a Markdown page, a heading that exists), and every `admission` command in
//! their shell blocks uses only flags that the command's own `--help` lists.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root: the workspace's, whose member this package is.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the broker is a member of the workspace at the root")
        .to_owned()
}

/// The pages under test: the READMEs, the changelog, the benchmarks and every page of `docs/`
/// and `broker/docs/`.
fn pages() -> Vec<PathBuf> {
    let root = root();
    let mut pages: Vec<PathBuf> = [
        "README.md",
        "README-library.md",
        "broker/README.md",
        "CHANGELOG.md",
        "BENCHMARKS.md",
    ]
    .iter()
    .map(|name| root.join(name))
    .filter(|path| path.is_file())
    .collect();
    assert_eq!(pages.len(), 5, "every front page is read");
    let mut dirs = vec![root.join("docs"), root.join("broker/docs")];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    pages.sort();
    pages
}

/// A page's lines outside fenced code blocks, with inline code spans blanked, each with its
/// line number; and the fenced blocks as (info string, first line number, text).
struct Parsed {
    /// (line number, the line with inline code blanked, the line as written).
    prose: Vec<(usize, String, String)>,
    blocks: Vec<(String, usize, String)>,
}

fn parse(text: &str) -> Parsed {
    let mut prose = Vec::new();
    let mut blocks = Vec::new();
    let mut fence: Option<(String, String, usize, String)> = None;
    for (n, line) in text.lines().enumerate() {
        let number = n + 1;
        let trimmed = line.trim_start();
        if let Some((marker, info, start, body)) = &mut fence {
            if trimmed.starts_with(marker.as_str()) && trimmed.trim_end() == marker.as_str() {
                blocks.push((std::mem::take(info), *start, std::mem::take(body)));
                fence = None;
            } else {
                body.push_str(line);
                body.push('\n');
            }
            continue;
        }
        let marker: String = trimmed
            .chars()
            .take_while(|&c| c == '`' || c == '~')
            .collect();
        if marker.len() >= 3 && marker.chars().all(|c| c == marker.chars().next().unwrap()) {
            let info = trimmed[marker.len()..].trim().to_string();
            fence = Some((marker, info, number + 1, String::new()));
            continue;
        }
        prose.push((number, blank_code_spans(line), line.to_string()));
    }
    Parsed { prose, blocks }
}

/// `line` with every inline code span replaced by spaces, so a link written as code is no link.
fn blank_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        let ticks = rest[start..].chars().take_while(|&c| c == '`').count();
        let closing = "`".repeat(ticks);
        out.push_str(&rest[..start]);
        let after = &rest[start + ticks..];
        match after.find(&closing) {
            Some(end) => {
                out.push_str(&" ".repeat(ticks * 2 + end));
                rest = &after[end + ticks..];
            }
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// The targets of the inline links (`[text](target)`, `![alt](target)`) and reference
/// definitions (`[label]: target`) on one prose line.
fn link_targets(line: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let trimmed = line.trim_start();
    if trimmed.starts_with('[')
        && let Some(close) = trimmed.find("]:")
    {
        let target = trimmed[close + 2..].split_whitespace().next().unwrap_or("");
        targets.push(target.trim_matches(['<', '>']).to_string());
    }
    let bytes = line.as_bytes();
    let mut i = 0;
    while let Some(found) = line[i..].find("](") {
        let open = i + found + 2;
        let mut depth = 0usize;
        let mut end = open;
        while end < bytes.len() {
            match bytes[end] {
                b'(' => depth += 1,
                b')' if depth == 0 => break,
                b')' => depth -= 1,
                _ => {}
            }
            end += 1;
        }
        let inside = &line[open..end];
        // `[text](target "title")`: the target is the first word.
        let target = inside.split_whitespace().next().unwrap_or("");
        targets.push(target.trim_matches(['<', '>']).to_string());
        i = end.min(line.len());
        if i == open {
            i += 1;
        }
    }
    targets
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors a Markdown page offers: one per heading, with `-1`, `-2`… for repeats.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut anchors = BTreeSet::new();
    for (_, _, line) in parse(text).prose {
        let trimmed = line.trim_start();
        let hashes = trimmed.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !trimmed[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(&trimmed[hashes..].replace('`', ""));
        let count = seen.entry(base.clone()).or_insert(0);
        anchors.insert(if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        });
        *count += 1;
    }
    anchors
}

/// What is wrong with the links of the page at `page` (whose text is `text`): one line each.
fn broken_links(page: &Path, text: &str) -> Vec<String> {
    let mut broken = Vec::new();
    let dir = page.parent().expect("a page has a folder");
    let own_anchors = anchors(text);
    for (number, line, _) in parse(text).prose {
        for target in link_targets(&line) {
            if target.is_empty()
                || target.contains("://")
                || target.starts_with("mailto:")
                || target.starts_with('/')
            {
                continue;
            }
            let (file, anchor) = match target.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (target.as_str(), None),
            };
            let here = format!("{}:{number}", page.display());
            if file.is_empty() {
                if let Some(anchor) = anchor
                    && !own_anchors.contains(anchor)
                {
                    broken.push(format!("{here}: no heading here for #{anchor}"));
                }
                continue;
            }
            let path = dir.join(file);
            if !path.exists() {
                broken.push(format!("{here}: {file} does not exist"));
                continue;
            }
            if let Some(anchor) = anchor
                && path.extension().is_some_and(|e| e == "md")
            {
                let linked = std::fs::read_to_string(&path).expect("a linked page reads");
                if !anchors(&linked).contains(anchor) {
                    broken.push(format!("{here}: {file} has no heading for #{anchor}"));
                }
            }
        }
    }
    broken
}

#[test]
fn every_relative_link_names_a_file_that_exists() {
    let pages = pages();
    assert!(
        pages.iter().any(|p| p.ends_with("README.md")),
        "README.md is read"
    );
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).expect("a page reads");
        broken.extend(broken_links(page, &text));
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn a_link_to_a_missing_file_or_heading_is_reported() {
    let page = root().join("README.md");
    let text = "# Here\n\nSee [the code](src/lib.rs), [gone](src/nowhere.rs), \
                [up](#here), [lost](#nowhere), `[not a link](nowhere.md)` and\n\
                [the README](README.md#no-such-heading).\n\n```sh\n[x](nowhere-in-code.md)\n```\n\
                [ref]: docs/missing.md\n";
    let broken = broken_links(&page, text);
    assert_eq!(broken.len(), 4, "{broken:#?}");
    assert!(
        broken[0].ends_with("src/nowhere.rs does not exist"),
        "{broken:#?}"
    );
    assert!(
        broken[1].ends_with("no heading here for #nowhere"),
        "{broken:#?}"
    );
    assert!(
        broken[2].ends_with("README.md has no heading for #no-such-heading"),
        "{broken:#?}"
    );
    assert!(
        broken[3].ends_with("docs/missing.md does not exist"),
        "{broken:#?}"
    );
}

#[test]
fn anchors_follow_github() {
    let page = "# The `admission` command\n## Faults: the counts stay true\n## Faults: the counts stay true\n### 5. Agent V1 (exactly)\n";
    let anchors = anchors(page);
    for expected in [
        "the-admission-command",
        "faults-the-counts-stay-true",
        "faults-the-counts-stay-true-1",
        "5-agent-v1-exactly",
    ] {
        assert!(anchors.contains(expected), "{expected} in {anchors:?}");
    }
}

const SUBCOMMANDS: [&str; 4] = ["serve", "check", "drill", "defaults"];

/// Every `admission SUB` (or `cargo run … -- SUB`) command in a page's shell blocks, with the
/// flags written after the subcommand: (line number, subcommand, flags).
fn commands(text: &str) -> Vec<(usize, &'static str, Vec<String>)> {
    let mut found = Vec::new();
    for (info, start, body) in parse(text).blocks {
        let lang = info.split([' ', ',', '{']).next().unwrap_or("");
        if !matches!(lang, "sh" | "bash" | "shell" | "console" | "") {
            continue;
        }
        // Continued lines are one command.
        let mut joined: Vec<(usize, String)> = Vec::new();
        let mut continuing = false;
        for (n, line) in body.lines().enumerate() {
            let line = line.trim_end();
            let (text, continues) = match line.strip_suffix('\\') {
                Some(head) => (head, true),
                None => (line, false),
            };
            if continuing {
                joined
                    .last_mut()
                    .expect("a line to continue")
                    .1
                    .push_str(text);
            } else {
                joined.push((start + n, text.to_string()));
            }
            continuing = continues;
        }
        for (number, line) in joined {
            let code = line.split(" #").next().unwrap_or("");
            if code.trim_start().starts_with('#') {
                continue;
            }
            for command in code.split(['|', ';', '&', '(', ')', '$']) {
                let words: Vec<&str> = command.split_whitespace().collect();
                let Some(at) = words.iter().position(|w| {
                    *w == "admission"
                        || w.ends_with("/admission")
                        || *w == "--" && words.first().is_some_and(|first| *first == "cargo")
                }) else {
                    continue;
                };
                let Some(sub) = words
                    .get(at + 1)
                    .and_then(|w| SUBCOMMANDS.iter().find(|s| **s == *w))
                else {
                    continue;
                };
                let flags = words[at + 2..]
                    .iter()
                    .filter(|w| w.starts_with("--") && w.len() > 2)
                    .map(|w| w.split('=').next().unwrap_or(w).to_string())
                    .collect();
                found.push((number, *sub, flags));
            }
        }
    }
    found
}

/// The long flags `admission SUB --help` lists.
fn known_flags(sub: &str) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_admission"))
        .args([sub, "--help"])
        .output()
        .expect("admission runs");
    assert!(out.status.success(), "admission {sub} --help succeeds");
    let help = String::from_utf8(out.stdout).expect("help is UTF-8");
    help.split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == '[')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| {
            w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
                .to_string()
        })
        .collect()
}

#[test]
fn shell_blocks_use_only_flags_the_commands_know() {
    let mut known: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for sub in SUBCOMMANDS {
        known.insert(sub, known_flags(sub));
    }
    assert!(
        known["serve"].contains("--listen") && known["check"].contains("--identities"),
        "the help is read: {known:?}"
    );
    let mut unknown = Vec::new();
    let mut seen = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a page reads");
        for (number, sub, flags) in commands(&text) {
            seen += 1;
            for flag in flags {
                if !known[sub].contains(&flag) {
                    unknown.push(format!(
                        "{}:{number}: admission {sub} has no {flag}",
                        page.display()
                    ));
                }
            }
        }
    }
    assert!(seen > 0, "the README's commands are found");
    assert!(unknown.is_empty(), "unknown flags:\n{}", unknown.join("\n"));
}

#[test]
fn commands_are_found_with_their_flags() {
    let page = "```sh\n\
                cargo run --release -- serve --listen 127.0.0.1:9 \\\n  --data /tmp/x # --not-this\n\
                ./target/release/admission check --identities a,b /abs/q.json && admission drill\n\
                curl -s --max-time 2 http://x/ | jq .\n\
                ```\n\
                ```rust\nadmission serve --in-rust\n```\n";
    let found = commands(page);
    assert_eq!(
        found,
        vec![
            (
                2,
                "serve",
                vec!["--listen".to_string(), "--data".to_string()]
            ),
            (4, "check", vec!["--identities".to_string()]),
            (4, "drill", vec![]),
        ]
    );
}
