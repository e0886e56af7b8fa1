//! Arbitrary bytes as an Operator V1 decision (the first byte picks the action, the rest is the body);
//! see `unyolo_admission_broker::fuzzing::operator_decision` for the invariants checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| unyolo_admission_broker::fuzzing::operator_decision(data));
