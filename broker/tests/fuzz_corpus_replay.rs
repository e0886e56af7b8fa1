//! Replays every committed fuzz corpus file of the broker's targets (`fuzz/corpus/<target>/*` at
//! the repository root) through the same function the cargo-fuzz target calls, so CI covers the
//! corpora on stable without a fuzzer.

mod support;

use support::corpus::{judge_seeds, replay};
use unyolo_admission_broker::fuzzing;

#[test]
fn every_agent_query_corpus_file_holds_the_invariants() {
    assert!(replay("agent_query", fuzzing::agent_query) >= 12);
}

#[test]
fn every_submission_corpus_file_holds_the_invariants() {
    assert!(replay("submission", fuzzing::submission) >= 12);
}

#[test]
fn every_operator_decision_corpus_file_holds_the_invariants() {
    assert!(replay("operator_decision", fuzzing::operator_decision) >= 12);
}

#[test]
fn every_operator_list_query_corpus_file_holds_the_invariants() {
    assert!(replay("operator_list_query", fuzzing::operator_list_query) >= 12);
}

#[test]
fn every_event_cursor_corpus_file_holds_the_invariants() {
    assert!(replay("event_cursor", fuzzing::event_cursor) >= 12);
}

#[test]
fn agent_query_seeds_are_judged_as_their_names_say() {
    let (valid, invalid) = judge_seeds("agent_query", fuzzing::agent_query_accepted);
    assert!(
        valid >= 3 && invalid >= 3,
        "{valid} valid, {invalid} invalid"
    );
}

#[test]
fn event_cursor_seeds_are_judged_as_their_names_say() {
    let (valid, invalid) = judge_seeds("event_cursor", fuzzing::event_cursor_accepted);
    assert!(
        valid >= 3 && invalid >= 3,
        "{valid} valid, {invalid} invalid"
    );
}

#[test]
fn submission_seeds_are_judged_as_their_names_say() {
    let (valid, invalid) = judge_seeds("submission", fuzzing::submission_accepted);
    assert!(
        valid >= 3 && invalid >= 3,
        "{valid} valid, {invalid} invalid"
    );
}

#[test]
fn operator_seeds_are_judged_as_their_names_say() {
    for (target, accepted) in [
        (
            "operator_decision",
            fuzzing::operator_decision_accepted as fn(&[u8]) -> bool,
        ),
        ("operator_list_query", fuzzing::operator_list_query_accepted),
    ] {
        let (valid, invalid) = judge_seeds(target, accepted);
        assert!(
            valid >= 3 && invalid >= 3,
            "{target}: {valid} valid, {invalid} invalid"
        );
    }
}
