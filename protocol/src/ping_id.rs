//! [`PingId`], carried by both `ping` (client) and `pong` (server).

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

/// A `ping` / `pong` id: any JSON string or number, echoed verbatim.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum PingId {
    Number(serde_json::Number),
    String(String),
}

impl From<u64> for PingId {
    fn from(n: u64) -> Self {
        PingId::Number(n.into())
    }
}

impl From<&str> for PingId {
    fn from(s: &str) -> Self {
        PingId::String(s.to_owned())
    }
}

impl<'de> Deserialize<'de> for PingId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = PingId;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or number")
            }
            fn visit_u64<E>(self, v: u64) -> Result<PingId, E> {
                Ok(PingId::Number(v.into()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<PingId, E> {
                Ok(PingId::Number(v.into()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<PingId, E> {
                serde_json::Number::from_f64(v).map(PingId::Number).ok_or_else(|| E::custom("ping id must be a finite number"))
            }
            fn visit_str<E>(self, v: &str) -> Result<PingId, E> {
                Ok(PingId::String(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<PingId, E> {
                Ok(PingId::String(v))
            }
        }
        d.deserialize_any(V)
    }
}
