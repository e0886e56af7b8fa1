//! What the integration tests share, in one tree (each test binary compiles it whole, so a
//! helper one binary does not use is allowed to be dead there).
#![allow(dead_code)]

pub mod redis;
#[cfg(feature = "redis")]
pub mod semantics;
