//! Arbitrary bytes as an operation submission body; see
//! `unyolo_admission_broker::fuzzing::submission` for the invariants checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| unyolo_admission_broker::fuzzing::submission(data));
