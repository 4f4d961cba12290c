//! GGUF metadata values.

use std::fmt;

use crate::error::GgufError;
use crate::reader::Cursor;

/// A metadata value, exactly as typed in the file.
///
/// Integer types are kept distinct (rather than widened on read) so that a
/// writer could round-trip the file and so that `Debug` output shows what the
/// converter actually wrote; use the `as_*` accessors to read them loosely.
///
/// A `Value` is 32 bytes, so parsed metadata takes at most ~32x its encoded
/// size (the worst case being a `u8` array); since every length is checked
/// against the file size first, this bounds metadata memory by the file size.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

/// GGUF value type ids (`gguf_type` in ggml's gguf.h).
pub(crate) mod tag {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// Nested arrays are legal GGUF but nobody writes more than one level; the
/// cap keeps a malicious file from recursing the parser off the stack.
const MAX_ARRAY_DEPTH: usize = 8;

/// Smallest encoding of one value of type `t`, used to bound array counts by
/// the bytes left in the file. `None` for an unknown type id.
fn min_encoded_size(t: u32) -> Option<usize> {
    Some(match t {
        tag::U8 | tag::I8 | tag::BOOL => 1,
        tag::U16 | tag::I16 => 2,
        tag::U32 | tag::I32 | tag::F32 => 4,
        tag::U64 | tag::I64 | tag::F64 => 8,
        tag::STRING => 8,    // u64 length, possibly empty
        tag::ARRAY => 4 + 8, // element type + count, possibly empty
        _ => return None,
    })
}

impl Value {
    /// Parses one value of type `t` at the cursor.
    pub(crate) fn parse(c: &mut Cursor<'_>, t: u32) -> Result<Value, GgufError> {
        Self::parse_at_depth(c, t, 0)
    }

    fn parse_at_depth(c: &mut Cursor<'_>, t: u32, depth: usize) -> Result<Value, GgufError> {
        Ok(match t {
            tag::U8 => Value::U8(c.u8("u8 value")?),
            tag::I8 => Value::I8(c.u8("i8 value")? as i8),
            tag::U16 => Value::U16(c.u16("u16 value")?),
            tag::I16 => Value::I16(c.u16("i16 value")? as i16),
            tag::U32 => Value::U32(c.u32("u32 value")?),
            tag::I32 => Value::I32(c.u32("i32 value")? as i32),
            tag::U64 => Value::U64(c.u64("u64 value")?),
            tag::I64 => Value::I64(c.u64("i64 value")? as i64),
            tag::F32 => Value::F32(c.f32("f32 value")?),
            tag::F64 => Value::F64(c.f64("f64 value")?),
            tag::BOOL => {
                let at = c.pos();
                match c.u8("bool value")? {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => return Err(GgufError::InvalidMetadata(format!("bool at byte offset {at} has value {b} (must be 0 or 1)"))),
                }
            }
            tag::STRING => Value::String(c.string("string value")?),
            tag::ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::InvalidMetadata(format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels at byte offset {}", c.pos())));
                }
                let at = c.pos();
                let elem = c.u32("array element type")?;
                let min =
                    min_encoded_size(elem).ok_or_else(|| GgufError::InvalidMetadata(format!("array at byte offset {at} has unknown element type {elem}")))?;
                let n = c.count(min, "array length")?;
                // `count` bounded n by the file size; still, reserve lazily so
                // the Vec grows only as elements are actually decoded.
                let mut items = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    items.push(Self::parse_at_depth(c, elem, depth + 1)?);
                }
                Value::Array(items)
            }
            other => return Err(GgufError::InvalidMetadata(format!("unknown value type {other} at byte offset {}", c.pos().saturating_sub(4)))),
        })
    }

    /// The GGUF name of this value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// Any integer type that is non-negative, widened to `u64`.
    ///
    /// Converters disagree on integer widths (`u32` vs `i32` vs `u64` for the
    /// same key), so consumers should not care which one they got.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type that fits in `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// `F32` as is, or `F64` rounded to `f32`.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// `F64` as is, or `F32` widened.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Human-readable rendering; long arrays are abbreviated so that dumping the
/// metadata of a model with a 150k-token vocabulary stays readable.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(a) => {
                const SHOW: usize = 8;
                f.write_str("[")?;
                for (i, v) in a.iter().take(SHOW).enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                if a.len() > SHOW {
                    write!(f, ", ... ({} items)", a.len())?;
                }
                f.write_str("]")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_accessors_convert_across_widths() {
        assert_eq!(Value::U8(7).as_u64(), Some(7));
        assert_eq!(Value::I32(7).as_u64(), Some(7));
        assert_eq!(Value::I32(-1).as_u64(), None);
        assert_eq!(Value::U64(u64::MAX).as_i64(), None);
        assert_eq!(Value::I16(-3).as_i64(), Some(-3));
        assert_eq!(Value::F32(1.0).as_u64(), None);
        assert_eq!(Value::F64(0.5).as_f32(), Some(0.5));
        assert_eq!(Value::U32(1).as_f32(), None);
        assert_eq!(Value::Bool(true).as_u64(), None);
    }

    #[test]
    fn display_abbreviates_long_arrays() {
        let a = Value::Array((0..20).map(Value::U32).collect());
        assert_eq!(a.to_string(), "[0, 1, 2, 3, 4, 5, 6, 7, ... (20 items)]");
        assert_eq!(Value::String("a\"b".into()).to_string(), "\"a\\\"b\"");
    }

    #[test]
    fn bool_must_be_zero_or_one() {
        assert_eq!(Value::parse(&mut Cursor::new(&[1]), tag::BOOL).unwrap(), Value::Bool(true));
        assert!(matches!(Value::parse(&mut Cursor::new(&[2]), tag::BOOL), Err(GgufError::InvalidMetadata(_))));
    }

    #[test]
    fn deep_nesting_is_rejected_not_recursed() {
        // 1000 levels of "array of 1 array": must error, not overflow the stack.
        let mut buf = Vec::new();
        for _ in 0..1000 {
            buf.extend_from_slice(&tag::ARRAY.to_le_bytes());
            buf.extend_from_slice(&1u64.to_le_bytes());
        }
        // Pad so the count checks pass and only the depth limit can trip.
        buf.extend_from_slice(&[0u8; 64]);
        let mut c = Cursor::new(&buf);
        match Value::parse(&mut c, tag::ARRAY) {
            Err(GgufError::InvalidMetadata(m)) => assert!(m.contains("nested"), "{m}"),
            other => panic!("expected InvalidMetadata, got {other:?}"),
        }
    }
}
