//! What the broker's integration tests share, in one tree: a test file says `mod support;` and
//! takes what it needs from the file of that concern. The servers and helpers the library's tests
//! use too (`redis-server`, polling, the model tests' generator) are the library's files, taken
//! by path so each is written once.
//!
//! - [`secrets`]: the clients and the operator every broker test knows, and their secrets.
//! - [`eventually`]: polling until a condition holds, with one bound for every test.
//! - [`http`]: the submission body the tests send and the reply they read back.
//! - [`metrics`]: one series read from a Prometheus text exposition.
//! - [`contract`]: the Agent V1 schema every reply is checked against.
//! - [`events`]: the Operator V1 event stream read by a real SSE parser, every event checked.
//! - [`operator_contract`]: the Operator V1 contract (vendored yaml), its digest and validators.
//! - [`operator`]: an operator speaking Operator V1 to the operator listener, every reply checked
//!   against the vendored contract ([`operator_contract`]).
//! - [`broker`]: a broker started in-process on loopback, and the harness that talks to it.
//! - [`faults`]: clients that hang up, a store held locked, and the ending every fault test shares.
//! - [`serve`]: the `admission serve` binary as a process, and the files it reads.
//! - [`quota`]: the quota fields of a submission answer, parsed back.
//! - [`requests`]: the Operator V1 suites' requests, decisions and pages.
//! - [`redis`]: a real `redis-server` on loopback (restarted empty or flushed on demand).
//! - [`redis_ha`]: Redis highly available on loopback (a primary, replicas, three Sentinels).
//! - [`postgres`]: a real PostgreSQL (`initdb` in a temporary directory) on loopback.
//! - [`houses`]: a store of each house (SQLite, PostgreSQL) for the store conformance tests.
//! - [`rng`]: the deterministic generator of the model tests.
//!
//! Each test binary compiles the tree whole, so a helper one binary does not use is dead there.
#![allow(dead_code)]

pub mod broker;
pub mod contract;
#[path = "../../../tests/support/corpus.rs"]
pub mod corpus;
pub mod events;
#[path = "../../../tests/support/eventually.rs"]
pub mod eventually;
pub mod faults;
pub mod houses;
pub mod http;
pub mod metrics;
pub mod operator;
pub mod operator_contract;
pub mod postgres;
pub mod quota;
#[path = "../../../tests/support/redis.rs"]
pub mod redis;
#[path = "../../../tests/support/redis_ha.rs"]
pub mod redis_ha;
pub mod requests;
#[path = "../../../tests/support/rng.rs"]
pub mod rng;
pub mod secrets;
pub mod serve;
