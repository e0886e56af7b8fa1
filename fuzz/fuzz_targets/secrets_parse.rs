//! Arbitrary bytes as a client secrets file and an operator secret file; see
//! `unyolo_admission::fuzzing::secrets_parse` for the invariants checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| unyolo_admission::fuzzing::secrets_parse(data));
