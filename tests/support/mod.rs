//! What the integration tests share, in one tree: a test file says `mod support;` and takes what
//! it needs from the file of that concern.
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
//! - [`redis`]: a real `redis-server` on loopback (restarted empty or flushed on demand).
//! - [`redis_ha`]: Redis highly available on loopback: a primary, its replicas and three
//!   Sentinels, or a three-primary Redis Cluster, every process stopped with its test.
//! - [`postgres`]: a real PostgreSQL (`initdb` in a temporary directory) on loopback.
//! - [`rng`]: the deterministic generator of the model tests.
//! - [`semantics`]: one face for the in-process and the Redis admission backends.
//!
//! Each test binary compiles the tree whole, so a helper one binary does not use is dead there.
#![allow(dead_code)]

#[cfg(feature = "broker")]
pub mod broker;
#[cfg(feature = "broker")]
pub mod contract;
#[cfg(feature = "broker")]
pub mod events;
#[cfg(any(feature = "broker", feature = "redis"))]
pub mod eventually;
#[cfg(feature = "broker")]
pub mod faults;
#[cfg(feature = "broker")]
pub mod http;
pub mod metrics;
#[cfg(feature = "broker")]
pub mod operator;
pub mod operator_contract;
#[cfg(feature = "broker")]
pub mod postgres;
#[cfg(feature = "broker")]
pub mod quota;
pub mod redis;
#[cfg(feature = "redis")]
pub mod redis_ha;
pub mod rng;
pub mod secrets;
#[cfg(feature = "redis")]
pub mod semantics;
#[cfg(feature = "broker")]
pub mod serve;
