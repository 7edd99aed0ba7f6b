//! What a serde `Config` reads, asked of serde itself rather than listed by hand: the keys a
//! derived struct accepts (aliases included), and deserialisation that names the key whose value
//! failed (serde_json's own messages do not).

use serde::de::value::MapDeserializer;
use serde::de::{self, DeserializeOwned, Visitor};
use serde_json::{Map, Value};
use std::cell::RefCell;
use std::fmt;

/// The keys a derived `Deserialize` struct reads: the `FIELDS` serde passes to
/// `deserialize_struct`, which list every alias.
pub fn keys_of<T: DeserializeOwned>() -> &'static [&'static str] {
    match T::deserialize(Probe) {
        Err(Probed(Some(fields))) => fields,
        _ => &[],
    }
}

/// Deserialises `map` into `T`. On failure: the key whose value failed (`None` when serde's
/// message names the field itself, as for a missing one) and serde's message.
pub fn from_map<T: DeserializeOwned>(map: &Map<String, Value>) -> Result<T, (Option<String>, String)> {
    let current = RefCell::new(None);
    let mut entries = map.iter();
    let pairs = std::iter::from_fn(|| {
        let next = entries.next();
        *current.borrow_mut() = next.map(|(k, _)| k.clone());
        next.map(|(k, v)| (k.as_str(), v))
    });
    T::deserialize(MapDeserializer::<_, serde_json::Error>::new(pairs))
        .map_err(|e| (current.borrow_mut().take(), e.to_string()))
}

/// A deserializer that only records the fields of the struct asked of it.
struct Probe;

#[derive(Debug)]
struct Probed(Option<&'static [&'static str]>);

impl fmt::Display for Probed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("field probe")
    }
}

impl std::error::Error for Probed {}

impl de::Error for Probed {
    fn custom<T: fmt::Display>(_: T) -> Self {
        Probed(None)
    }
}

impl<'de> de::Deserializer<'de> for Probe {
    type Error = Probed;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Probed> {
        Err(Probed(None))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Probed> {
        Err(Probed(Some(fields)))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option
        unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize, Debug)]
    #[allow(dead_code)]
    struct Sample {
        size: usize,
        #[serde(alias = "other_name")]
        named: Option<f64>,
    }

    #[test]
    fn the_keys_of_a_struct_include_its_aliases() {
        let mut keys = keys_of::<Sample>().to_vec();
        keys.sort();
        assert_eq!(keys, vec!["named", "other_name", "size"]);
    }

    #[test]
    fn a_failing_value_is_named_by_its_key() {
        let v: Value = serde_json::from_str(r#"{"named": 1.5, "size": -3}"#).unwrap();
        let (key, message) = from_map::<Sample>(v.as_object().unwrap()).unwrap_err();
        assert_eq!(key.as_deref(), Some("size"), "{message}");
        let v: Value = serde_json::from_str(r#"{"named": 1.5}"#).unwrap();
        let (key, message) = from_map::<Sample>(v.as_object().unwrap()).unwrap_err();
        assert_eq!(key, None);
        assert!(message.contains("size"), "{message}");
    }
}
