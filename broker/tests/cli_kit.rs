//! `admission kit`: an installed binary writes the rules, their tests and the dashboard exactly as
//! `deploy/` holds them, and never overwrites or half-writes without being asked to.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use assert_cmd::Command;
use unyolo_admission_broker::serve::{DASHBOARD_FILE, RULES_FILE};

fn admission() -> Command {
    Command::cargo_bin("admission").unwrap()
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn kit(args: &[&str]) -> Run {
    let output = admission().arg("kit").args(args).output().unwrap();
    Run {
        code: output.status.code().unwrap(),
        stdout: String::from_utf8(output.stdout).unwrap(),
        stderr: String::from_utf8(output.stderr).unwrap(),
    }
}

/// Every file under `root`, by its path relative to `root`, with its bytes.
fn tree(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, files: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, files);
            } else {
                let name = path.strip_prefix(root).unwrap().to_owned();
                files.insert(name, std::fs::read(&path).unwrap());
            }
        }
    }
    let mut files = BTreeMap::new();
    walk(root, root, &mut files);
    files
}

fn deploy() -> BTreeMap<PathBuf, Vec<u8>> {
    tree(&Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy"))
}

#[test]
fn kit_writes_every_deploy_file_as_the_repository_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("monitoring");
    let run = kit(&["--out", out.to_str().unwrap()]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let written = tree(&out);
    assert_eq!(
        written.keys().collect::<Vec<_>>(),
        deploy().keys().collect::<Vec<_>>()
    );
    assert!(written == deploy(), "a written file differs from deploy/");
    // Among them, the two files `serve` names.
    for named in [RULES_FILE, DASHBOARD_FILE] {
        let name = Path::new(named).strip_prefix("deploy").unwrap();
        assert!(written.contains_key(name), "{named} was not written");
    }
    // It says what it wrote, one path a line.
    for name in written.keys() {
        let path = out.join(name);
        assert!(
            run.stdout.lines().any(|l| Path::new(l) == path),
            "{} not listed:\n{}",
            path.display(),
            run.stdout
        );
    }
}

#[test]
fn kit_refuses_a_file_as_its_output_directory_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yml");
    std::fs::write(&file, "mine\n").unwrap();
    let run = kit(&["--out", file.to_str().unwrap()]);
    assert_eq!(run.code, 1, "{}", run.stdout);
    assert!(
        run.stderr.contains(&format!(
            "{} is not a directory; nothing was written",
            file.display()
        )),
        "{}",
        run.stderr
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine\n");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn kit_overwrites_nothing_without_force_and_everything_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    assert_eq!(kit(&["--out", out.to_str().unwrap()]).code, 0);
    // An operator edited the dashboard and removed the rules' tests.
    let dashboard = out.join("grafana/admission.json");
    let tests = out.join("prometheus/tests/admission.rules.test.yml");
    std::fs::write(&dashboard, "edited").unwrap();
    std::fs::remove_file(&tests).unwrap();

    let run = kit(&["--out", out.to_str().unwrap()]);
    assert_eq!(run.code, 1, "{}", run.stdout);
    assert!(
        run.stderr
            .contains("exists; nothing was written (--force overwrites)"),
        "{}",
        run.stderr
    );
    assert_eq!(std::fs::read_to_string(&dashboard).unwrap(), "edited");
    assert!(!tests.exists(), "a file was written despite the refusal");

    let run = kit(&["--out", out.to_str().unwrap(), "--force"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(tree(out) == deploy(), "--force did not restore deploy/");
}
