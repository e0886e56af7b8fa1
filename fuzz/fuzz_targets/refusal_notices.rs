//! Arbitrary bytes as the notices a replica's refusal memory hears; see
//! `unyolo_admission::fuzzing::refusal_notices` for the invariants checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| unyolo_admission::fuzzing::refusal_notices(data));
