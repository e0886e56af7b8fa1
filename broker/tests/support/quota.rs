//! The quota fields of a submission answer (`RateLimit-Policy`, `RateLimit`), parsed back as
//! structured fields with `sfv`.

use std::collections::HashMap;

use sfv::{BareItem, List, ListEntry, Parser};

use super::http::Reply;

/// Five tokens an hour (one back every 12 minutes: nothing refills while a test runs), roomy
/// capacity.
pub const FIVE_AN_HOUR: &str = r#"{"requests_per_window": 5, "window_seconds": 3600,
  "client_active": 25, "client_pending": 10, "global_active": 100, "global_executing": 10}"#;

/// One field: policy name → its parameters, as integers or strings.
pub type Field = HashMap<String, HashMap<String, Param>>;

#[derive(Debug, PartialEq, Eq)]
pub enum Param {
    Int(i64),
    Str(String),
}

fn parse(value: &str) -> Field {
    let list: List = Parser::new(value).parse().expect("a structured-field list");
    list.into_iter()
        .map(|entry| {
            let ListEntry::Item(item) = entry else {
                panic!("an item, not an inner list: {value}")
            };
            let name = item
                .bare_item
                .as_string()
                .expect("a String policy name")
                .as_str()
                .to_owned();
            let params = item
                .params
                .iter()
                .map(|(key, bare)| {
                    let param = match bare {
                        BareItem::Integer(n) => Param::Int(i64::from(*n)),
                        BareItem::String(s) => Param::Str(s.as_str().to_owned()),
                        other => panic!("unexpected parameter {other:?} in {value}"),
                    };
                    (key.as_str().to_owned(), param)
                })
                .collect();
            (name, params)
        })
        .collect()
}

pub struct Quota {
    pub policy: Field,
    pub limit: Field,
}

impl Quota {
    pub fn of(reply: &Reply) -> Quota {
        let policy = reply
            .header("ratelimit-policy")
            .unwrap_or_else(|| panic!("no RateLimit-Policy on a {} answer", reply.status));
        let limit = reply
            .header("ratelimit")
            .unwrap_or_else(|| panic!("no RateLimit on a {} answer", reply.status));
        Quota {
            policy: parse(policy),
            limit: parse(limit),
        }
    }

    pub fn policy(&self, name: &str, param: &str) -> Option<i64> {
        match self.policy.get(name)?.get(param)? {
            Param::Int(n) => Some(*n),
            Param::Str(_) => None,
        }
    }

    pub fn limit(&self, name: &str, param: &str) -> Option<i64> {
        match self.limit.get(name)?.get(param)? {
            Param::Int(n) => Some(*n),
            Param::Str(_) => None,
        }
    }
}
