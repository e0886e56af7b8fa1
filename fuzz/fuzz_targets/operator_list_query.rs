//! Arbitrary bytes as the query string of the Operator V1 request list (with its cursor);
//! see `unyolo_admission_broker::fuzzing::operator_list_query` for the invariants checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| unyolo_admission_broker::fuzzing::operator_list_query(data));
