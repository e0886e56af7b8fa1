//! Gives the crate the commit it was built from (`ADMISSION_BUILD_COMMIT`): `git rev-parse
//! --short HEAD`, or `unknown` outside a git checkout or without git. Never fails the build.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let commit = git(&["rev-parse", "--short", "HEAD"])
        .filter(|c| c.bytes().all(|b| b.is_ascii_hexdigit()))
        .unwrap_or_else(|| "unknown".to_owned());
    // Rebuild when HEAD moves: the HEAD file, the branch ref it names, and packed refs. Only
    // files that exist: cargo takes a missing one as changed and would rebuild every time.
    if commit != "unknown" {
        let mut watched = vec!["HEAD".to_owned(), "packed-refs".to_owned()];
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watched.push(branch);
        }
        for name in &watched {
            if let Some(path) = git(&["rev-parse", "--git-path", name])
                && std::path::Path::new(&path).exists()
            {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
    println!("cargo:rustc-env=ADMISSION_BUILD_COMMIT={commit}");
}
