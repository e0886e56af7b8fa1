//! Arbitrary bytes as the start of an Operator V1 event stream (a cursor, the `cursor` query,
//! the `Last-Event-ID` header); see `unyolo_admission_broker::fuzzing::event_cursor` for the
//! invariants checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| unyolo_admission_broker::fuzzing::event_cursor(data));
