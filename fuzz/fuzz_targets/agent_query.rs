//! Arbitrary bytes as the query string of the Agent V1 listing (with its cursor) and long poll;
//! see `unyolo_admission_broker::fuzzing::agent_query` for the invariants checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| unyolo_admission_broker::fuzzing::agent_query(data));
