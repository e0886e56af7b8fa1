//! The clients and the operators every broker test knows, with their secrets: as the library's
//! [`Secrets`] and [`Operators`], and as the text of the files `admission serve` reads.

use unyolo_admission::config::{Operators, Secrets};

pub const AGENT: &str = "agent";
pub const AGENT_SECRET: &str = "agent-secret-0123";
pub const OTHER: &str = "other";
pub const OTHER_SECRET: &str = "other-secret-4567";
/// The operator every test decides as.
pub const OPERATOR: &str = "operator";
pub const OPERATOR_SECRET: &str = "operator-secret-89ab-0123456789abcdef";
/// A second operator, with a name as people write theirs.
pub const OTHER_OPERATOR: &str = "Grace Hopper";
pub const OTHER_OPERATOR_SECRET: &str = "grace-secret-cdef-0123456789abcdef";

/// The secrets file: [`AGENT`] and [`OTHER`], one line each.
pub fn secrets_file() -> String {
    format!("{AGENT} = {AGENT_SECRET}\n{OTHER} = {OTHER_SECRET}\n")
}

/// The secrets file, parsed.
pub fn secrets() -> Secrets {
    Secrets::parse(&secrets_file()).unwrap()
}

/// The operator secrets file: [`OPERATOR`] and [`OTHER_OPERATOR`].
pub fn operator_secrets_file() -> String {
    format!(
        "# the operators\n{OPERATOR} = {OPERATOR_SECRET}\n{OTHER_OPERATOR} = {OTHER_OPERATOR_SECRET}\n"
    )
}

/// The operator secrets file, parsed.
pub fn operators() -> Operators {
    Operators::parse(&operator_secrets_file()).unwrap()
}
