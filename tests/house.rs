//! House rules that the compiler does not check, for both crates of the workspace (the library
//! under `src/`, the reference broker under `broker/src/`): imports between the files of a crate
//! run one way (no file reaches back, directly or around a circle, to a file that imports it); no
//! Rust file of the repository grows past 1,000 lines; the broker reaches the library through its
//! public API only (it is another crate: the compiler enforces that, and this checks that
//! nothing brings the broker back inside the library); and no public item of the library goes
//! undocumented (`#![deny(missing_docs)]` at its root, which the compiler enforces).
//!
//! The import graph is built from the source, parsed with `syn`. File A depends on file B when A
//! names an item through a path — a `use` tree, or a path anywhere else (a type, an expression, a
//! pattern, the tokens of a macro call) — that starts with `crate`, `super`, `self`, a child
//! module of the module it is written in, or a name a `use` in that module bound to a module, and
//! whose longest prefix that is a module lives in B. A `mod x;` declaration is no edge, but
//! `pub use x::Y;` is one (to `x`'s file), and a path to an item a `mod.rs` re-exports resolves to
//! that `mod.rs`. Visibility (`pub(crate)`, `pub(super)`) names no item and is no edge. Paths in
//! an inline `mod tests { use super::*; }` resolve from the inline module, so they point back at
//! their own file: no edge.
//!
//! `HOUSE_EDGES=1 cargo test --test house -- --nocapture` prints every edge with the path that
//! made it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

/// The most lines a Rust file of the repository may have.
const MOST_LINES: usize = 1_000;

/// The source folders of the workspace's crates, from the repository root (this package's).
const CRATE_SOURCES: [&str; 2] = ["src", "broker/src"];

/// A module's path from its crate's root: `["store", "postgres", "events"]`.
type ModulePath = Vec<String>;

/// The repository root: this package's manifest dir (the library is the workspace's root).
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir` (from the repository root), as (path from the root, contents),
/// sorted.
fn rust_files(dir: &str) -> Vec<(String, String)> {
    let root = root();
    let mut files = Vec::new();
    let mut dirs = vec![root.join(dir)];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path: PathBuf = entry.unwrap().path();
            if path.is_dir() {
                if path
                    .file_name()
                    .is_some_and(|n| n == "target" || n == "corpus")
                {
                    continue;
                }
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let name = path.strip_prefix(root).unwrap().to_string_lossy();
                let name = name.replace('\\', "/");
                files.push((name, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    files.sort();
    files
}

/// The crate (`lib` or `main`) a file of a crate's source folder belongs to and its module path
/// in it, from where it lies: `src/a/b.rs` and `src/a/b/mod.rs` are both `a::b` of the library,
/// as `broker/src/a/b.rs` is `a::b` of the broker.
fn module_of(file: &str) -> (&'static str, ModulePath) {
    let rel = CRATE_SOURCES
        .iter()
        .rev()
        .find_map(|dir| file.strip_prefix(dir).and_then(|r| r.strip_prefix('/')))
        .expect("a file of a crate's source folder");
    let rel = rel.strip_suffix(".rs").expect("a .rs file");
    if rel == "main" {
        return ("main", Vec::new());
    }
    if rel == "lib" {
        return ("lib", Vec::new());
    }
    let mut path: ModulePath = rel.split('/').map(str::to_owned).collect();
    if path.last().is_some_and(|last| last == "mod") {
        path.pop();
    }
    ("lib", path)
}

/// What one file names: the `use` leaves and other paths, each with the module it is written in.
#[derive(Default)]
struct Names {
    /// (module written in, segments, the name it binds or `None` for a glob).
    uses: Vec<(ModulePath, Vec<String>, Option<String>)>,
    /// (module written in, segments) of every other path.
    paths: Vec<(ModulePath, Vec<String>)>,
    /// Inline modules (`mod tests { }`) the file holds.
    inline_modules: Vec<ModulePath>,
}

/// Walks one file's syntax tree, keeping the module path of the inline `mod` block it is in.
struct Collector {
    module: ModulePath,
    names: Names,
}

impl Collector {
    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let name = n.ident.to_string();
                if name == "self" {
                    let bound = prefix.last().cloned();
                    self.names
                        .uses
                        .push((self.module.clone(), prefix.clone(), bound));
                } else {
                    let mut segments = prefix.clone();
                    segments.push(name.clone());
                    self.names
                        .uses
                        .push((self.module.clone(), segments, Some(name)));
                }
            }
            syn::UseTree::Rename(r) => {
                let mut segments = prefix.clone();
                if r.ident != "self" {
                    segments.push(r.ident.to_string());
                }
                let bound = Some(r.rename.to_string());
                self.names.uses.push((self.module.clone(), segments, bound));
            }
            syn::UseTree::Glob(_) => {
                self.names
                    .uses
                    .push((self.module.clone(), prefix.clone(), None));
            }
            syn::UseTree::Group(g) => {
                for item in &g.items {
                    self.use_tree(prefix, item);
                }
            }
        }
    }

    /// Paths in a macro call's tokens, which `syn` leaves unparsed: every run of
    /// `ident :: ident :: ...` of two segments or more.
    fn tokens(&mut self, tokens: TokenStream) {
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < trees.len() {
            match &trees[i] {
                TokenTree::Group(group) => {
                    self.tokens(group.stream());
                    i += 1;
                }
                TokenTree::Ident(first) => {
                    let mut segments = vec![first.to_string()];
                    let mut j = i + 1;
                    while let (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b))) =
                        (trees.get(j), trees.get(j + 1))
                    {
                        if a.as_char() != ':' || b.as_char() != ':' {
                            break;
                        }
                        let Some(TokenTree::Ident(next)) = trees.get(j + 2) else {
                            break;
                        };
                        segments.push(next.to_string());
                        j += 3;
                    }
                    if segments.len() > 1 {
                        self.names.paths.push((self.module.clone(), segments));
                    }
                    i = j;
                }
                TokenTree::Punct(_) | TokenTree::Literal(_) => i += 1,
            }
        }
    }
}

impl<'ast> Visit<'ast> for Collector {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.module.push(item.ident.to_string());
        if item.content.is_some() {
            self.names.inline_modules.push(self.module.clone());
        }
        syn::visit::visit_item_mod(self, item);
        self.module.pop();
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        if item.leading_colon.is_none() {
            self.use_tree(&mut Vec::new(), &item.tree);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() {
            let segments = path.segments.iter().map(|s| s.ident.to_string()).collect();
            self.names.paths.push((self.module.clone(), segments));
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {
        // `pub(crate)`, `pub(super)`, `pub(in crate::x)` say who may see an item; they name none.
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.tokens(mac.tokens.clone());
        syn::visit::visit_macro(self, mac);
    }
}

/// The import edges between `files` (path relative to the package, contents), as
/// (importing file, imported file), by the rule in this file's module doc.
fn import_edges(files: &[(String, String)]) -> BTreeSet<(String, String)> {
    // Every module of each crate and the file it lives in: files, then inline modules.
    let mut modules: BTreeMap<(&str, ModulePath), String> = BTreeMap::new();
    let mut names: Vec<(&str, &str, ModulePath, Names)> = Vec::new();
    for (file, source) in files {
        let (krate, module) = module_of(file);
        let syntax =
            syn::parse_file(source).unwrap_or_else(|e| panic!("{file} does not parse: {e}"));
        let mut collector = Collector {
            module: module.clone(),
            names: Names::default(),
        };
        collector.visit_file(&syntax);
        modules.insert((krate, module.clone()), file.clone());
        names.push((file, krate, module, collector.names));
    }
    for (file, krate, _, found) in &names {
        for inline in &found.inline_modules {
            modules
                .entry((krate, inline.clone()))
                .or_insert_with(|| (*file).to_owned());
        }
    }
    let is_child = |krate: &str, module: &ModulePath, name: &str| {
        let mut child = module.clone();
        child.push(name.to_owned());
        modules.contains_key(&(krate, child))
    };

    // The path of `segments`, written in `module`, from the crate's root; `None` when it leads
    // out of the crate (std, a dependency, a local name).
    let absolute = |krate: &str,
                    module: &ModulePath,
                    aliases: &BTreeMap<(ModulePath, String), ModulePath>,
                    segments: &[String]|
     -> Option<ModulePath> {
        let (first, rest) = segments.split_first()?;
        let mut base = match first.as_str() {
            "crate" => Vec::new(),
            "self" => module.clone(),
            "super" => {
                let mut parent = module.clone();
                parent.pop()?;
                parent
            }
            name if is_child(krate, module, name) => {
                let mut child = module.clone();
                child.push(name.to_owned());
                child
            }
            name => aliases.get(&(module.clone(), name.to_owned()))?.clone(),
        };
        let mut rest = rest.iter().peekable();
        while rest.peek().is_some_and(|s| *s == "super") {
            base.pop()?;
            rest.next();
        }
        base.extend(rest.cloned());
        Some(base)
    };

    // The file of the longest prefix of `path` that is a module.
    let file_of = |krate: &str, path: &ModulePath| -> String {
        (0..=path.len())
            .rev()
            .find_map(|n| modules.get(&(krate, path[..n].to_vec())))
            .expect("the crate root is a module")
            .clone()
    };

    let mut edges = BTreeSet::new();
    for (file, krate, _, found) in &names {
        // Names a `use` bound to a module of the crate, per module, so `store::Database` after
        // `use super::store;` is followed.
        let mut aliases: BTreeMap<(ModulePath, String), ModulePath> = BTreeMap::new();
        let none = BTreeMap::new();
        for (module, segments, bound) in &found.uses {
            let (Some(bound), Some(path)) = (bound, absolute(krate, module, &none, segments))
            else {
                continue;
            };
            if modules.contains_key(&(*krate, path.clone())) {
                aliases.insert((module.clone(), bound.clone()), path);
            }
        }
        let uses = found.uses.iter().map(|(m, s, _)| (m, s, 1));
        // Other paths of one segment are local names (a variable, a function, a type in scope).
        let paths = found.paths.iter().map(|(m, s)| (m, s, 2));
        for (module, segments, shortest) in uses.chain(paths) {
            if segments.len() < shortest {
                continue;
            }
            let Some(path) = absolute(krate, module, &aliases, segments) else {
                continue;
            };
            let target = file_of(krate, &path);
            if target != *file && std::env::var_os("HOUSE_EDGES").is_some() {
                eprintln!("EDGE {file} -> {target}: {}", segments.join("::"));
            }
            if target != *file {
                edges.insert(((*file).to_owned(), target));
            }
        }
    }
    edges
}

/// The circles in the graph `edges`, each as its files in order with the first repeated at the
/// end (`a.rs -> b.rs -> a.rs`), starting from its least file. Tarjan's algorithm finds the
/// strongly connected components; within each, every edge is shown in the shortest circle
/// through it, so every import that closes a circle is named without listing the (many more)
/// longer ways around the same files.
fn find_circles(edges: &BTreeSet<(String, String)>) -> Vec<Vec<String>> {
    let mut graph: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in edges {
        graph.entry(from).or_default().push(to);
        graph.entry(to).or_default();
    }
    let mut circles: BTreeSet<Vec<String>> = BTreeSet::new();
    for component in strongly_connected(&graph).iter().filter(|c| c.len() > 1) {
        let inside: BTreeSet<&str> = component.iter().copied().collect();
        for &from in component {
            for &to in graph[from].iter().filter(|to| inside.contains(*to)) {
                let mut circle = vec![from];
                circle.extend(shortest_path(&graph, &inside, to, from));
                // The same circle, whichever edge found it, starts at its least file.
                circle.pop();
                let least = (0..circle.len()).min_by_key(|&i| circle[i]).unwrap();
                circle.rotate_left(least);
                circle.push(circle[0]);
                circles.insert(circle.into_iter().map(str::to_owned).collect());
            }
        }
    }
    circles.into_iter().collect()
}

/// The shortest path from `from` to `to` (both included) over files `inside`, breadth first.
fn shortest_path<'a>(
    graph: &BTreeMap<&'a str, Vec<&'a str>>,
    inside: &BTreeSet<&'a str>,
    from: &'a str,
    to: &'a str,
) -> Vec<&'a str> {
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([from]);
    while let Some(node) = queue.pop_front() {
        if node == to {
            break;
        }
        for &next in &graph[node] {
            if inside.contains(next) && next != from && !came_from.contains_key(next) {
                came_from.insert(next, node);
                queue.push_back(next);
            }
        }
    }
    let mut path = vec![to];
    while *path.last().unwrap() != from {
        path.push(came_from[path.last().unwrap()]);
    }
    path.reverse();
    path
}

/// Tarjan's strongly connected components of `graph`.
fn strongly_connected<'a>(graph: &BTreeMap<&'a str, Vec<&'a str>>) -> Vec<Vec<&'a str>> {
    struct Tarjan<'g, 'a> {
        graph: &'g BTreeMap<&'a str, Vec<&'a str>>,
        next_index: usize,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        components: Vec<Vec<&'a str>>,
    }
    impl<'a> Tarjan<'_, 'a> {
        fn visit(&mut self, node: &'a str) {
            self.index.insert(node, self.next_index);
            self.low.insert(node, self.next_index);
            self.next_index += 1;
            self.stack.push(node);
            self.on_stack.insert(node);
            for &next in &self.graph[node] {
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[node].min(self.low[next]);
                    self.low.insert(node, low);
                } else if self.on_stack.contains(next) {
                    let low = self.low[node].min(self.index[next]);
                    self.low.insert(node, low);
                }
            }
            if self.low[node] == self.index[node] {
                let mut component = Vec::new();
                loop {
                    let member = self.stack.pop().unwrap();
                    self.on_stack.remove(member);
                    component.push(member);
                    if member == node {
                        break;
                    }
                }
                component.sort();
                self.components.push(component);
            }
        }
    }
    let mut tarjan = Tarjan {
        graph,
        next_index: 0,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for &node in graph.keys() {
        if !tarjan.index.contains_key(node) {
            tarjan.visit(node);
        }
    }
    tarjan.components
}

fn short(file: &str) -> &str {
    file.strip_prefix("src/").unwrap_or(file)
}

#[test]
fn each_crates_files_import_one_way() {
    let mut report: Vec<String> = Vec::new();
    for dir in CRATE_SOURCES {
        let files = rust_files(dir);
        assert!(files.len() > 10, "{dir} is read");
        for circle in find_circles(&import_edges(&files)) {
            let files: Vec<&str> = circle.iter().map(|f| short(f)).collect();
            report.push(files.join(" -> "));
        }
    }
    assert!(
        report.is_empty(),
        "{} import circle(s) between files of one crate (a type two files share moves to a file \
         both import, or to a small leaf):\n{}",
        report.len(),
        report.join("\n"),
    );
}

#[test]
fn no_rust_file_over_1000_lines() {
    let mut files = Vec::new();
    for dir in ["src", "tests", "benches", "broker", "fuzz/fuzz_targets"] {
        files.extend(rust_files(dir));
    }
    assert!(files.len() > 100, "the repository is read");
    let long: Vec<String> = files
        .iter()
        .filter_map(|(file, source)| {
            let lines = source.lines().count();
            (lines > MOST_LINES).then(|| format!("{file}: {lines} lines"))
        })
        .collect();
    assert!(
        long.is_empty(),
        "Rust files over {MOST_LINES} lines (split by concern):\n{}",
        long.join("\n")
    );
}

#[test]
fn the_library_documents_every_public_item_and_knows_nothing_of_the_broker() {
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).unwrap();
    assert!(
        lib.lines().any(|l| l.trim() == "#![deny(missing_docs)]"),
        "src/lib.rs denies missing docs"
    );
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let library = manifest
        .split("[dev-dependencies]")
        .next()
        .expect("the library's manifest");
    for dependency in [
        "axum",
        "hyper",
        "rusqlite",
        "tokio-postgres",
        "reqwest",
        "clap",
        "unyolo-admission-broker",
    ] {
        assert!(
            !library.lines().any(|l| l.starts_with(dependency)),
            "the library depends on {dependency}"
        );
    }
    for (file, source) in rust_files("src") {
        let named = source
            .lines()
            .filter(|line| !line.trim_start().starts_with("//"))
            .any(|line| line.contains("unyolo_admission_broker"));
        assert!(!named, "{file} names the broker crate");
    }
}

fn synthetic(files: &[(&str, &str)]) -> Vec<(String, String)> {
    files
        .iter()
        .map(|(f, s)| ((*f).to_owned(), (*s).to_owned()))
        .collect()
}

fn edge(from: &str, to: &str) -> (String, String) {
    (from.to_owned(), to.to_owned())
}

#[test]
fn circle_finder_reports_a_known_circle_and_nothing_acyclic() {
    let edges: BTreeSet<(String, String)> = [
        edge("a.rs", "b.rs"),
        edge("b.rs", "c.rs"),
        edge("c.rs", "a.rs"),
        edge("d.rs", "a.rs"),
        edge("d.rs", "e.rs"),
        edge("e.rs", "f.rs"),
        edge("f.rs", "e.rs"),
        edge("g.rs", "h.rs"),
    ]
    .into();
    let circles = find_circles(&edges);
    assert_eq!(
        circles,
        vec![
            vec!["a.rs", "b.rs", "c.rs", "a.rs"],
            vec!["e.rs", "f.rs", "e.rs"],
        ]
    );
    let acyclic: BTreeSet<(String, String)> = [
        edge("a.rs", "b.rs"),
        edge("b.rs", "c.rs"),
        edge("a.rs", "c.rs"),
    ]
    .into();
    assert!(find_circles(&acyclic).is_empty());
}

#[test]
fn resolver_follows_reexports_super_and_inline_paths() {
    let files = synthetic(&[
        ("src/lib.rs", "pub mod shop;"),
        // A re-export is an edge to the child; `Till` is defined here.
        (
            "src/shop/mod.rs",
            "mod till; mod shelf; pub use till::Receipt; pub struct Till;",
        ),
        // `super::Till` resolves to shop/mod.rs: a circle with the re-export above.
        ("src/shop/till.rs", "use super::Till; pub struct Receipt;"),
        // An inline path to a sibling; a visibility is no edge; `use super::*` in an inline test
        // module points at this file itself.
        (
            "src/shop/shelf.rs",
            "pub(crate) fn f() { crate::shop::till::Receipt; } \
             #[cfg(test)] mod tests { use super::*; }",
        ),
    ]);
    let edges = import_edges(&files);
    let expected: BTreeSet<(String, String)> = [
        edge("src/shop/mod.rs", "src/shop/till.rs"),
        edge("src/shop/shelf.rs", "src/shop/till.rs"),
        edge("src/shop/till.rs", "src/shop/mod.rs"),
    ]
    .into();
    assert_eq!(edges, expected);
    assert_eq!(
        find_circles(&edges),
        vec![vec![
            "src/shop/mod.rs",
            "src/shop/till.rs",
            "src/shop/mod.rs"
        ]]
    );
}

#[test]
fn resolver_follows_a_module_a_use_bound_and_paths_in_macros() {
    let files = synthetic(&[
        ("src/lib.rs", "mod a; mod b;"),
        ("src/a.rs", "use crate::b; fn f() { b::inner::g(); }"),
        ("src/b/mod.rs", "pub mod inner;"),
        (
            "src/b/inner.rs",
            "fn g() { println!(\"{}\", crate::a::X); }",
        ),
    ]);
    let edges = import_edges(&files);
    let expected: BTreeSet<(String, String)> = [
        edge("src/a.rs", "src/b/inner.rs"),
        edge("src/a.rs", "src/b/mod.rs"),
        edge("src/b/inner.rs", "src/a.rs"),
    ]
    .into();
    assert_eq!(edges, expected);
    assert_eq!(find_circles(&edges).len(), 1);
}
