//! Replays every committed fuzz corpus file of the library's targets (`fuzz/corpus/<target>/*`)
//! through the same function the cargo-fuzz target calls, so CI covers the corpora on stable
//! without a fuzzer. The broker's targets are replayed by its own `fuzz_corpus_replay`.

use std::path::Path;

use unyolo_admission::config::secrets::Secrets;
use unyolo_admission::config::{Config, Identity};
use unyolo_admission::fuzzing;

mod support;
use support::corpus::{corpus_root, judge_seeds, replay};

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

#[cfg(feature = "redis")]
#[test]
fn every_redis_reply_corpus_file_holds_the_invariants() {
    assert!(replay("redis_reply", fuzzing::redis_reply) >= 12);
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

#[cfg(feature = "redis")]
/// Thousands of pseudo-random replies, so a plain `cargo test` explores beyond the corpus.
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
    for entry in std::fs::read_dir(corpus_root()).expect("fuzz/corpus exists") {
        let name = entry.expect("entry").file_name();
        assert!(
            [
                "config_parse",
                "controller_ops",
                "secrets_parse",
                "agent_query",
                "submission",
                "redis_reply",
                "event_cursor",
                "operator_decision",
                "operator_list_query",
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
    assert_eq!(targets, 10);
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
