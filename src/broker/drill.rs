//! `admission drill`: the overload drill end to end against an in-process broker on loopback.

/// Runs the drill, printing each step; returns whether every step held.
pub fn run() -> bool {
    false
}
