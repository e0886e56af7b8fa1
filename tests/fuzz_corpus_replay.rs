//! Replays every committed fuzz corpus file (`fuzz/corpus/<target>/*`) through the same function
//! the cargo-fuzz target calls, so CI covers the corpora on stable without a fuzzer.

use std::path::Path;

use unyolo_admission::config::secrets::Secrets;
use unyolo_admission::config::{Config, Identity};
use unyolo_admission::fuzzing;

fn replay(target: &str, run: fn(&[u8])) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("readable corpus entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    for path in &files {
        let data = std::fs::read(path).expect("readable corpus file");
        let outcome = std::panic::catch_unwind(|| run(&data));
        assert!(outcome.is_ok(), "{} fails {target}", path.display());
    }
    files.len()
}

#[test]
fn every_config_parse_corpus_file_holds_the_invariants() {
    assert!(replay("config_parse", fuzzing::config_parse) >= 12);
}

#[test]
fn every_controller_ops_corpus_file_holds_the_invariants() {
    assert!(replay("controller_ops", fuzzing::controller_ops) >= 12);
}

#[test]
fn every_secrets_parse_corpus_file_holds_the_invariants() {
    assert!(replay("secrets_parse", fuzzing::secrets_parse) >= 12);
}

#[cfg(feature = "broker")]
#[test]
fn every_agent_query_corpus_file_holds_the_invariants() {
    assert!(replay("agent_query", fuzzing::agent_query) >= 12);
}

#[cfg(feature = "broker")]
#[test]
fn every_submission_corpus_file_holds_the_invariants() {
    assert!(replay("submission", fuzzing::submission) >= 12);
}

#[cfg(feature = "redis")]
#[test]
fn every_redis_reply_corpus_file_holds_the_invariants() {
    assert!(replay("redis_reply", fuzzing::redis_reply) >= 12);
}

/// Seed files named `valid_*` must be accepted and `invalid_*` refused (by `accepts`), so the
/// seeds reach both the round-trip checks and the error paths they were written for. Returns how
/// many of each there are.
fn judge_seeds(target: &str, accepts: impl Fn(&[u8]) -> bool) -> (usize, usize) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let (mut valid, mut invalid) = (0, 0);
    for entry in std::fs::read_dir(dir).expect("corpus exists") {
        let path = entry.expect("entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let data = std::fs::read(&path).expect("readable");
        if name.starts_with("valid_") {
            assert!(accepts(&data), "{target}/{name} was refused");
            valid += 1;
        } else if name.starts_with("invalid_") {
            assert!(!accepts(&data), "{target}/{name} was accepted");
            invalid += 1;
        }
    }
    (valid, invalid)
}

#[test]
fn config_seeds_are_judged_as_their_names_say() {
    let identities = fuzzing::CONFIG_IDENTITIES.map(|n| Identity::new(n).expect("valid"));
    let (valid, invalid) = judge_seeds("config_parse", |data| {
        Config::from_bytes(data, identities.clone()).is_ok()
    });
    assert!(
        valid >= 3 && invalid >= 3,
        "{valid} valid, {invalid} invalid"
    );
}

#[test]
fn secrets_seeds_are_judged_as_their_names_say() {
    let (valid, invalid) = judge_seeds("secrets_parse", |data| Secrets::from_bytes(data).is_ok());
    assert!(
        valid >= 3 && invalid >= 3,
        "{valid} valid, {invalid} invalid"
    );
}

#[cfg(feature = "broker")]
#[test]
fn agent_query_seeds_are_judged_as_their_names_say() {
    let (valid, invalid) = judge_seeds("agent_query", fuzzing::agent_query_accepted);
    assert!(
        valid >= 3 && invalid >= 3,
        "{valid} valid, {invalid} invalid"
    );
}

#[cfg(feature = "broker")]
#[test]
fn submission_seeds_are_judged_as_their_names_say() {
    let (valid, invalid) = judge_seeds("submission", fuzzing::submission_accepted);
    assert!(
        valid >= 3 && invalid >= 3,
        "{valid} valid, {invalid} invalid"
    );
}

#[cfg(feature = "redis")]
#[test]
fn every_refusal_notices_corpus_file_holds_the_invariants() {
    assert!(replay("refusal_notices", fuzzing::refusal_notices) >= 5);
}

#[cfg(feature = "redis")]
#[test]
fn redis_reply_seeds_are_judged_as_their_names_say() {
    let (valid, invalid) = judge_seeds("redis_reply", fuzzing::redis_reply_accepted);
    assert!(
        valid >= 3 && invalid >= 3,
        "{valid} valid, {invalid} invalid"
    );
}

/// Thousands of pseudo-random replies, so a plain `cargo test` explores beyond the corpus.
#[cfg(feature = "redis")]
#[test]
fn pseudo_random_redis_replies_hold_the_invariants() {
    let mut state: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let alphabet = b"*$+:_O#,%~\n0123456789adelmoprstu-";
    for _ in 0..3_000 {
        let len = (next() % 64) as usize;
        let data: Vec<u8> = (0..len)
            .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
            .collect();
        fuzzing::redis_reply(&data);
    }
}

#[test]
fn every_corpus_directory_has_a_replay() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    for entry in std::fs::read_dir(root).expect("fuzz/corpus exists") {
        let name = entry.expect("entry").file_name();
        assert!(
            [
                "config_parse",
                "controller_ops",
                "secrets_parse",
                "agent_query",
                "submission",
                "redis_reply",
                "refusal_notices"
            ]
            .contains(&name.to_str().unwrap_or("")),
            "no replay for fuzz/corpus/{name:?}"
        );
    }
}

/// `.ci/run` fuzzes every file in `fuzz/fuzz_targets/`, starting from its seed corpus.
#[test]
fn every_fuzz_target_has_a_seed_corpus() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut targets = 0;
    for entry in std::fs::read_dir(root.join("fuzz_targets")).expect("fuzz/fuzz_targets exists") {
        let path = entry.expect("entry").path();
        let target = path.file_stem().and_then(|s| s.to_str()).expect("named");
        assert!(
            root.join("corpus").join(target).is_dir(),
            "fuzz target {target} has no fuzz/corpus/{target}"
        );
        targets += 1;
    }
    assert_eq!(targets, 7);
}

/// A few thousand pseudo-random op sequences, so a plain `cargo test` explores beyond the corpus.
#[test]
fn pseudo_random_op_sequences_hold_the_invariants() {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..2_000 {
        let len = (next() % 300) as usize;
        let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        fuzzing::controller_ops(&data);
    }
}
