//! The fuzz corpora (`fuzz/corpus/<target>/`), replayed under plain `cargo test` by the library's
//! and the broker's `fuzz_corpus_replay` through the functions the cargo-fuzz targets call.

use std::path::{Path, PathBuf};

/// `fuzz/corpus` at the repository root, from the library's package or the broker's beside it.
pub fn corpus_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let here = manifest.join("fuzz/corpus");
    if here.is_dir() {
        return here;
    }
    manifest.join("../fuzz/corpus")
}

/// Runs every file of `target`'s corpus through `run`, failing on the first that panics; how
/// many files there were.
pub fn replay(target: &str, run: fn(&[u8])) -> usize {
    let dir = corpus_root().join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("readable corpus entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    for path in &files {
        let data = std::fs::read(path).expect("readable corpus file");
        let outcome = std::panic::catch_unwind(|| run(&data));
        assert!(outcome.is_ok(), "{} fails {target}", path.display());
    }
    files.len()
}

/// Seed files named `valid_*` must be accepted and `invalid_*` refused (by `accepts`), so the
/// seeds reach both the round-trip checks and the error paths they were written for. Returns how
/// many of each there are.
pub fn judge_seeds(target: &str, accepts: impl Fn(&[u8]) -> bool) -> (usize, usize) {
    let dir = corpus_root().join(target);
    let (mut valid, mut invalid) = (0, 0);
    for entry in std::fs::read_dir(dir).expect("corpus exists") {
        let path = entry.expect("entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let data = std::fs::read(&path).expect("readable");
        if name.starts_with("valid_") {
            assert!(accepts(&data), "{target}/{name} was refused");
            valid += 1;
        } else if name.starts_with("invalid_") {
            assert!(!accepts(&data), "{target}/{name} was accepted");
            invalid += 1;
        }
    }
    (valid, invalid)
}
