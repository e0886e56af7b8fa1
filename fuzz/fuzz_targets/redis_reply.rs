//! Arbitrary bytes as a Redis script reply; see `unyolo_admission::fuzzing::redis_reply` for the
//! decoding and the invariants checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| unyolo_admission::fuzzing::redis_reply(data));
