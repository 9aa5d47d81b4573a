//! Where a hint policy puts its actions: [`Actions`], a writer into the
//! router's own buffer.
//!
//! A policy calls [`Actions::push`] with the action's type, version and any
//! `Serialize` payload (a struct with named fields, a map, a
//! `serde_json::Value`). The payload is not turned into text here: a serde
//! serializer hands its values one by one to the router's JSON writer across
//! the boundary, so nothing the plugin allocates has to cross back and be
//! freed, and the router never parses a payload.

use crate::abi::FfiActionWriter;
use crate::policy::HintError;
use abi_stable::std_types::{RSlice, RStr};
use serde::ser::{self, Serialize};
use std::fmt::{self, Display};

/// The actions of one booking, as a policy writes them. Each [`push`](Self::push)
/// is one engine-format action; the router numbers them, caps them (32 per
/// message) and drops them all if the policy then returns an error.
pub struct Actions<'w> {
    raw: &'w mut FfiActionWriter,
}

impl<'w> Actions<'w> {
    #[doc(hidden)]
    pub fn new(raw: &'w mut FfiActionWriter) -> Self {
        Self { raw }
    }

    /// Writes one action, e.g. `kv.fetch` version `1.0`. The payload must
    /// serialize as a JSON object (a struct with named fields, a map, a `json!`
    /// object); anything else makes the policy's actions for this booking
    /// malformed (rule R8), and so does a float that is NaN or infinite.
    pub fn push<T: Serialize + ?Sized>(
        &mut self,
        action_type: &str,
        action_version: &str,
        payload: &T,
    ) -> Result<(), HintError> {
        let writer = &mut *self.raw;
        (writer.vtable.begin_action)(
            writer.state,
            RStr::from_str(action_type),
            RStr::from_str(action_version),
        );
        let result = payload.serialize(Values {
            writer: &mut *writer,
        });
        if let Err(error) = &result {
            (writer.vtable.fail)(writer.state, RStr::from_str(&error.0));
        }
        (writer.vtable.end_action)(writer.state);
        result.map_err(|e| HintError::new(format!("the payload does not serialize: {}", e.0)))
    }
}

/// Serializes a `[u64]` field in one call to the router's writer (the fast path
/// for a fetch's thousands of hashes); under any other serializer, an ordinary
/// sequence. Use it as `#[serde(serialize_with = "u64_array")]`.
pub fn u64_array<S: ser::Serializer>(values: &[u64], serializer: S) -> Result<S::Ok, S::Error> {
    let _lent = Lent::new(values);
    serializer.serialize_newtype_struct(U64_ARRAY_NAME, &Seq(values))
}

/// `values` lent to [`U64_ARRAY`] for as long as this lives: dropping it (on return
/// or during an unwind out of a panicking serializer) takes the pointer back, so the
/// slot never names a slice that is gone, and a slot already taken (a nested
/// `u64_array`) is restored as it was.
struct Lent {
    before: Option<(*const u64, usize)>,
}

impl Lent {
    fn new(values: &[u64]) -> Self {
        let before = U64_ARRAY.with(|slot| slot.replace(Some((values.as_ptr(), values.len()))));
        Self { before }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        U64_ARRAY.with(|slot| slot.set(self.before));
    }
}

const U64_ARRAY_NAME: &str = "\u{0}kvhint::u64_array";

thread_local! {
    /// The slice [`u64_array`] is serializing, for [`Values`] to write in one
    /// call when it recognises the marker name. Only read during that call.
    static U64_ARRAY: std::cell::Cell<Option<(*const u64, usize)>> = const { std::cell::Cell::new(None) };
}

struct Seq<'a>(&'a [u64]);

impl Serialize for Seq<'_> {
    fn serialize<S: ser::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0)
    }
}

/// A payload that could not be serialized.
#[derive(Debug)]
pub struct PayloadError(String);

impl Display for PayloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PayloadError {}

impl ser::Error for PayloadError {
    fn custom<T: Display>(message: T) -> Self {
        Self(message.to_string())
    }
}

/// Serializes one value into the router's writer.
struct Values<'a> {
    writer: &'a mut FfiActionWriter,
}

macro_rules! call {
    ($writer:expr, $f:ident $(, $arg:expr)*) => {
        ($writer.vtable.$f)($writer.state $(, $arg)*)
    };
}

impl<'a> ser::Serializer for Values<'a> {
    type Ok = ();
    type Error = PayloadError;
    type SerializeSeq = Compound<'a>;
    type SerializeTuple = Compound<'a>;
    type SerializeTupleStruct = Compound<'a>;
    type SerializeTupleVariant = Compound<'a>;
    type SerializeMap = Compound<'a>;
    type SerializeStruct = Compound<'a>;
    type SerializeStructVariant = Compound<'a>;

    fn serialize_bool(self, v: bool) -> Result<(), PayloadError> {
        call!(self.writer, bool, v);
        Ok(())
    }
    fn serialize_i8(self, v: i8) -> Result<(), PayloadError> {
        self.serialize_i64(v.into())
    }
    fn serialize_i16(self, v: i16) -> Result<(), PayloadError> {
        self.serialize_i64(v.into())
    }
    fn serialize_i32(self, v: i32) -> Result<(), PayloadError> {
        self.serialize_i64(v.into())
    }
    fn serialize_i64(self, v: i64) -> Result<(), PayloadError> {
        call!(self.writer, i64, v);
        Ok(())
    }
    fn serialize_i128(self, v: i128) -> Result<(), PayloadError> {
        if let Ok(v) = i64::try_from(v) {
            self.serialize_i64(v)
        } else if let Ok(v) = u64::try_from(v) {
            self.serialize_u64(v)
        } else {
            Err(PayloadError(format!("{v} does not fit in 64 bits")))
        }
    }
    fn serialize_u8(self, v: u8) -> Result<(), PayloadError> {
        self.serialize_u64(v.into())
    }
    fn serialize_u16(self, v: u16) -> Result<(), PayloadError> {
        self.serialize_u64(v.into())
    }
    fn serialize_u32(self, v: u32) -> Result<(), PayloadError> {
        self.serialize_u64(v.into())
    }
    fn serialize_u64(self, v: u64) -> Result<(), PayloadError> {
        call!(self.writer, u64, v);
        Ok(())
    }
    fn serialize_u128(self, v: u128) -> Result<(), PayloadError> {
        u64::try_from(v)
            .map_err(|_| PayloadError(format!("{v} does not fit in 64 bits")))
            .and_then(|v| self.serialize_u64(v))
    }
    fn serialize_f32(self, v: f32) -> Result<(), PayloadError> {
        self.serialize_f64(v.into())
    }
    fn serialize_f64(self, v: f64) -> Result<(), PayloadError> {
        call!(self.writer, f64, v);
        Ok(())
    }
    fn serialize_char(self, v: char) -> Result<(), PayloadError> {
        self.serialize_str(v.encode_utf8(&mut [0; 4]))
    }
    fn serialize_str(self, v: &str) -> Result<(), PayloadError> {
        call!(self.writer, string, RStr::from_str(v));
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), PayloadError> {
        // As serde_json does: an array of numbers.
        use ser::SerializeSeq;
        let mut seq = self.serialize_seq(Some(v.len()))?;
        for byte in v {
            seq.serialize_element(byte)?;
        }
        seq.end()
    }
    fn serialize_none(self) -> Result<(), PayloadError> {
        self.serialize_unit()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), PayloadError> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), PayloadError> {
        call!(self.writer, null);
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), PayloadError> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), PayloadError> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        value: &T,
    ) -> Result<(), PayloadError> {
        if name == U64_ARRAY_NAME {
            if let Some((pointer, len)) = U64_ARRAY.with(|slot| slot.get()) {
                // SAFETY: the slot is only `Some` while a `Lent` guard in
                // `u64_array` lives, which borrows the `&[u64]` it names for its
                // whole life and clears the slot when dropped, unwinding included;
                // this call runs inside that `u64_array` call.
                let values = unsafe { std::slice::from_raw_parts(pointer, len) };
                call!(self.writer, u64_array, RSlice::from_slice(values));
                return Ok(());
            }
        }
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), PayloadError> {
        call!(self.writer, begin_object);
        call!(self.writer, key, RStr::from_str(variant));
        value.serialize(Values {
            writer: &mut *self.writer,
        })?;
        call!(self.writer, end_object);
        Ok(())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Compound<'a>, PayloadError> {
        call!(self.writer, begin_array);
        Ok(Compound {
            writer: self.writer,
            close: Close::Array,
        })
    }
    fn serialize_tuple(self, len: usize) -> Result<Compound<'a>, PayloadError> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        len: usize,
    ) -> Result<Compound<'a>, PayloadError> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Compound<'a>, PayloadError> {
        call!(self.writer, begin_object);
        call!(self.writer, key, RStr::from_str(variant));
        call!(self.writer, begin_array);
        Ok(Compound {
            writer: self.writer,
            close: Close::ArrayInObject,
        })
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Compound<'a>, PayloadError> {
        call!(self.writer, begin_object);
        Ok(Compound {
            writer: self.writer,
            close: Close::Object,
        })
    }
    fn serialize_struct(self, _: &'static str, len: usize) -> Result<Compound<'a>, PayloadError> {
        self.serialize_map(Some(len))
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Compound<'a>, PayloadError> {
        call!(self.writer, begin_object);
        call!(self.writer, key, RStr::from_str(variant));
        call!(self.writer, begin_object);
        Ok(Compound {
            writer: self.writer,
            close: Close::ObjectInObject,
        })
    }
}

enum Close {
    Array,
    Object,
    ArrayInObject,
    ObjectInObject,
}

#[doc(hidden)]
pub struct Compound<'a> {
    writer: &'a mut FfiActionWriter,
    close: Close,
}

impl Compound<'_> {
    fn values(&mut self) -> Values<'_> {
        Values {
            writer: &mut *self.writer,
        }
    }

    fn finish(self) -> Result<(), PayloadError> {
        match self.close {
            Close::Array => call!(self.writer, end_array),
            Close::Object => call!(self.writer, end_object),
            Close::ArrayInObject => {
                call!(self.writer, end_array);
                call!(self.writer, end_object);
            }
            Close::ObjectInObject => {
                call!(self.writer, end_object);
                call!(self.writer, end_object);
            }
        }
        Ok(())
    }
}

impl ser::SerializeSeq for Compound<'_> {
    type Ok = ();
    type Error = PayloadError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), PayloadError> {
        value.serialize(self.values())
    }
    fn end(self) -> Result<(), PayloadError> {
        self.finish()
    }
}

impl ser::SerializeTuple for Compound<'_> {
    type Ok = ();
    type Error = PayloadError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), PayloadError> {
        value.serialize(self.values())
    }
    fn end(self) -> Result<(), PayloadError> {
        self.finish()
    }
}

impl ser::SerializeTupleStruct for Compound<'_> {
    type Ok = ();
    type Error = PayloadError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), PayloadError> {
        value.serialize(self.values())
    }
    fn end(self) -> Result<(), PayloadError> {
        self.finish()
    }
}

impl ser::SerializeTupleVariant for Compound<'_> {
    type Ok = ();
    type Error = PayloadError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), PayloadError> {
        value.serialize(self.values())
    }
    fn end(self) -> Result<(), PayloadError> {
        self.finish()
    }
}

impl ser::SerializeMap for Compound<'_> {
    type Ok = ();
    type Error = PayloadError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), PayloadError> {
        let key = key.serialize(KeyText)?;
        call!(self.writer, key, RStr::from_str(&key));
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), PayloadError> {
        value.serialize(self.values())
    }
    fn end(self) -> Result<(), PayloadError> {
        self.finish()
    }
}

impl ser::SerializeStruct for Compound<'_> {
    type Ok = ();
    type Error = PayloadError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), PayloadError> {
        call!(self.writer, key, RStr::from_str(key));
        value.serialize(self.values())
    }
    fn end(self) -> Result<(), PayloadError> {
        self.finish()
    }
}

impl ser::SerializeStructVariant for Compound<'_> {
    type Ok = ();
    type Error = PayloadError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), PayloadError> {
        call!(self.writer, key, RStr::from_str(key));
        value.serialize(self.values())
    }
    fn end(self) -> Result<(), PayloadError> {
        self.finish()
    }
}

/// A map key as JSON object keys must be: a string, or a number or boolean
/// written as one (as serde_json does).
struct KeyText;

impl ser::Serializer for KeyText {
    type Ok = String;
    type Error = PayloadError;
    type SerializeSeq = ser::Impossible<String, PayloadError>;
    type SerializeTuple = ser::Impossible<String, PayloadError>;
    type SerializeTupleStruct = ser::Impossible<String, PayloadError>;
    type SerializeTupleVariant = ser::Impossible<String, PayloadError>;
    type SerializeMap = ser::Impossible<String, PayloadError>;
    type SerializeStruct = ser::Impossible<String, PayloadError>;
    type SerializeStructVariant = ser::Impossible<String, PayloadError>;

    fn serialize_bool(self, v: bool) -> Result<String, PayloadError> {
        Ok(v.to_string())
    }
    fn serialize_i8(self, v: i8) -> Result<String, PayloadError> {
        Ok(v.to_string())
    }
    fn serialize_i16(self, v: i16) -> Result<String, PayloadError> {
        Ok(v.to_string())
    }
    fn serialize_i32(self, v: i32) -> Result<String, PayloadError> {
        Ok(v.to_string())
    }
    fn serialize_i64(self, v: i64) -> Result<String, PayloadError> {
        Ok(v.to_string())
    }
    fn serialize_u8(self, v: u8) -> Result<String, PayloadError> {
        Ok(v.to_string())
    }
    fn serialize_u16(self, v: u16) -> Result<String, PayloadError> {
        Ok(v.to_string())
    }
    fn serialize_u32(self, v: u32) -> Result<String, PayloadError> {
        Ok(v.to_string())
    }
    fn serialize_u64(self, v: u64) -> Result<String, PayloadError> {
        Ok(v.to_string())
    }
    fn serialize_f32(self, _: f32) -> Result<String, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_f64(self, _: f64) -> Result<String, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_char(self, v: char) -> Result<String, PayloadError> {
        Ok(v.to_string())
    }
    fn serialize_str(self, v: &str) -> Result<String, PayloadError> {
        Ok(v.to_string())
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<String, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_none(self) -> Result<String, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<String, PayloadError> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<String, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<String, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<String, PayloadError> {
        Ok(variant.to_string())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<String, PayloadError> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<String, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStruct, PayloadError> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, PayloadError> {
        Err(key_must_be_a_string())
    }
}

fn key_must_be_a_string() -> PayloadError {
    PayloadError("a map key must be a string, an integer, a char or a boolean".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink that fails the way a plugin's own code might, in the middle of an array.
    struct PanicsOnWrite;

    impl std::io::Write for PanicsOnWrite {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            panic!("the sink gave up");
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[derive(serde::Serialize)]
    struct Fetch {
        #[serde(serialize_with = "u64_array")]
        hashes: Vec<u64>,
    }

    fn lent() -> Option<(*const u64, usize)> {
        U64_ARRAY.with(|slot| slot.get())
    }

    #[test]
    fn a_serializer_that_panics_mid_array_leaves_no_pointer_to_the_dropped_slice() {
        let unwound = std::panic::catch_unwind(|| {
            let fetch = Fetch {
                hashes: vec![1, 2, 3],
            };
            let _ = serde_json::to_writer(PanicsOnWrite, &fetch);
        });
        assert!(unwound.is_err(), "the sink panics");
        assert_eq!(lent(), None, "the unwind took the lent slice back");
    }

    #[test]
    fn a_nested_u64_array_restores_the_outer_slice_when_it_ends() {
        let outer = [7u64, 8];
        let _outer = Lent::new(&outer);
        {
            let inner = [9u64];
            let _inner = Lent::new(&inner);
            assert_eq!(lent(), Some((inner.as_ptr(), 1)));
        }
        assert_eq!(lent(), Some((outer.as_ptr(), 2)));
    }

    #[test]
    fn under_another_serializer_u64_array_is_an_ordinary_sequence() {
        let fetch = Fetch {
            hashes: vec![1, u64::MAX],
        };
        let text = serde_json::to_string(&fetch).unwrap_or_default();
        assert_eq!(text, format!("{{\"hashes\":[1,{}]}}", u64::MAX));
        assert_eq!(lent(), None);
    }
}
