//! A JSON value read strictly: an object that names a key twice is an error at any depth.
//! `serde_json::Value` keeps the last of a repeated key, so `{"duration_ms":600001,
//! "duration_ms":0}` would pass for `{"duration_ms":0}`; unYOLO's own broker and clients refuse
//! such a body, and so does this one (400 `invalid_request`, as for any body the contract does
//! not allow).
//!
//! Numbers keep the text they came as (serde_json's `arbitrary_precision`): an agent's
//! `12345678901234567890123` or `1.50` is stored, digested and shown back as sent, as unYOLO's
//! own broker keeps its `json.RawMessage`, not rounded through an `f64`.

use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Deserializes a [`Value`], refusing an object with a repeated key anywhere inside it (use with
/// `#[serde(deserialize_with = "strict_json::value")]`).
pub(crate) fn value<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Value, D::Error> {
    deserializer.deserialize_any(StrictVisitor)
}

struct Strict(Value);

impl<'de> de::Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Strict, D::Error> {
        deserializer.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

/// The key under which serde_json (with `arbitrary_precision`) passes a number's text.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value whose objects name each key once")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("a number JSON cannot hold"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(StrictVisitor)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.is_empty() && key == NUMBER_TOKEN {
                // A number, as serde_json hands one over with `arbitrary_precision`: a map of
                // one entry whose value is the number's text (serde_json's own `Value` reads it
                // the same way).
                let text: String = map.next_value()?;
                return text
                    .parse::<Number>()
                    .map(Value::Number)
                    .map_err(de::Error::custom);
            }
            if object.contains_key(&key) {
                return Err(de::Error::custom(format_args!(
                    "the key {key:?} is given twice in one object"
                )));
            }
            let Strict(item) = map.next_value()?;
            object.insert(key, item);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strict(text: &str) -> Result<Value, serde_json::Error> {
        value(&mut serde_json::Deserializer::from_str(text))
    }

    #[test]
    fn a_repeated_key_is_refused_at_any_depth_and_everything_else_reads_as_serde_json_does() {
        for text in [
            r#"{"a":1,"a":1}"#,
            r#"{"a":{"b":1,"b":2}}"#,
            r#"[{"x":null,"x":null}]"#,
            r#"{"a":[1,{"c":"","c":""}]}"#,
        ] {
            let err = strict(text).unwrap_err().to_string();
            assert!(err.contains("given twice"), "{text}: {err}");
        }
        for text in [
            r#"{"a":1,"b":[true,null,-2,1.5,"s"],"c":{"a":{}}}"#,
            r#"[]"#,
            r#""text""#,
            "18446744073709551615",
            "-9223372036854775808",
            "1e300",
        ] {
            let lax: Value = serde_json::from_str(text).unwrap();
            assert_eq!(strict(text).unwrap(), lax, "{text}");
        }
    }

    #[test]
    fn numbers_keep_the_text_they_came_as() {
        // Every digit is kept; an exponent is written as serde_json writes it (`e`, with its
        // sign).
        for (text, kept) in [
            ("12345678901234567890123", "12345678901234567890123"),
            ("-98765432109876543210", "-98765432109876543210"),
            (
                "0.1000000000000000055511151231257827",
                "0.1000000000000000055511151231257827",
            ),
            ("1.50", "1.50"),
            ("1e2", "1e+2"),
            ("1E400", "1e+400"),
            ("2.5e-3", "2.5e-3"),
            ("-0", "-0"),
            ("5", "5"),
        ] {
            let read = strict(text).unwrap();
            assert!(read.is_number(), "{text}: {read}");
            assert_eq!(read.to_string(), kept);
            let nested = strict(&format!(r#"{{"a":[{text}],"b":{{"c":{text}}}}}"#)).unwrap();
            assert_eq!(nested["a"][0].to_string(), kept);
            assert_eq!(nested["b"]["c"].to_string(), kept);
        }
        assert_eq!(strict("600000").unwrap().as_u64(), Some(600_000));
    }
}
