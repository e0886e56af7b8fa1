//! Arbitrary bytes through the quota-file parser and validator; see
//! `unyolo_admission::fuzzing::config_parse` for the invariants checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| unyolo_admission::fuzzing::config_parse(data));
