//! The clients and the operator every broker test knows, with their secrets: as the library's
//! [`Secrets`], and as the text of the secrets file `admission serve` reads.

use unyolo_admission::config::Secrets;

pub const AGENT: &str = "agent";
pub const AGENT_SECRET: &str = "agent-secret-0123";
pub const OTHER: &str = "other";
pub const OTHER_SECRET: &str = "other-secret-4567";
pub const OPERATOR_SECRET: &str = "operator-secret-89ab";

/// The secrets file: [`AGENT`] and [`OTHER`], one line each.
pub fn secrets_file() -> String {
    format!("{AGENT} = {AGENT_SECRET}\n{OTHER} = {OTHER_SECRET}\n")
}

/// The secrets file, parsed.
pub fn secrets() -> Secrets {
    Secrets::parse(&secrets_file()).unwrap()
}
