//! Arbitrary op sequences against a controller with a manual clock; see
//! `unyolo_admission::fuzzing::controller_ops` for the invariants checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| unyolo_admission::fuzzing::controller_ops(data));
