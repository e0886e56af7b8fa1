//! The bodies of the broker's cargo-fuzz targets in `fuzz/` (the Agent V1 submission body, query
//! strings and cursors; Operator V1 decision bodies, list queries and event cursors), kept in the
//! crate so that a plain `cargo test` (`tests/fuzz_corpus_replay.rs`) replays every committed
//! corpus file through exactly the code the fuzzer runs. Not part of the public API, and behind
//! the cargo feature `fuzzing`: `fuzz/` turns it on, and so do this package's tests (through its
//! dev-dependency on itself). The library's parsers have theirs in `unyolo_admission::fuzzing`.
//!
//! Every function panics (through `assert!`) when an invariant of the contract breaks; that panic
//! is what the fuzzer reports as a crash and what the replay test reports as a failure.

mod broker;
pub use broker::{
    agent_query, agent_query_accepted, event_cursor, event_cursor_accepted, submission,
    submission_accepted,
};

mod operator;
pub use operator::{
    operator_decision, operator_decision_accepted, operator_list_query,
    operator_list_query_accepted,
};
