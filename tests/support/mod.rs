//! What the library's integration tests share, in one tree: a test file says `mod support;` and
//! takes what it needs from the file of that concern. The broker's tests share it too: their own
//! tree (`broker/tests/support/`) takes these files by path, so each is written once.
//!
//! - [`eventually`]: polling until a condition holds, with one bound for every test.
//! - [`redis`]: a real `redis-server` on loopback (restarted empty or flushed on demand).
//! - [`replicas`]: quota files and registered replicas for the replica tests.
//! - [`redis_ha`]: Redis highly available on loopback: a primary, its replicas and three
//!   Sentinels, or a three-primary Redis Cluster, every process stopped with its test.
//! - [`failover`]: a fleet of replicas under load through a Redis failover, and what every
//!   failover must leave behind.
//! - [`rng`]: the deterministic generator of the model tests.
//! - [`semantics`]: one face for the in-process and the Redis admission backends.
//!
//! Each test binary compiles the tree whole, so a helper one binary does not use is dead there.
#![allow(dead_code)]

pub mod corpus;
pub mod eventually;
#[cfg(feature = "redis")]
pub mod failover;
pub mod redis;
#[cfg(feature = "redis")]
pub mod redis_ha;
#[cfg(feature = "redis")]
pub mod replicas;
pub mod rng;
#[cfg(feature = "redis")]
pub mod semantics;
