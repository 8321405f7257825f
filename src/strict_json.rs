//! JSON with one meaning: RFC 8259 §4 leaves an object that names a member twice to each
//! parser (one keeps the first copy, another the last), so what sweeper reads from a caller —
//! a token's header and claims, a delivered envelope — is refused when any object in it, at any
//! depth, repeats a name (after unescaping: `"\u0073cope"` is `"scope"`).

/// Whether `bytes` are JSON in which some object names a member twice. Bytes that are not JSON
/// at all answer `false`: the caller's own parse says why.
pub fn repeats_a_name(bytes: &[u8]) -> bool {
    serde_json::from_slice::<UniqueNames>(bytes).is_err()
        && serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok()
}

/// A JSON value read only to prove that no object in it names a member twice.
struct UniqueNames;

impl<'de> serde::Deserialize<'de> for UniqueNames {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UniqueNamesVisitor)
    }
}

struct UniqueNamesVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueNamesVisitor {
    type Value = UniqueNames;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value without repeated member names")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<UniqueNames, A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(name) = map.next_key::<String>()? {
            if !seen.insert(name) {
                return Err(serde::de::Error::custom("a member name is repeated"));
            }
            map.next_value::<UniqueNames>()?;
        }
        Ok(UniqueNames)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<UniqueNames, A::Error> {
        while seq.next_element::<UniqueNames>()?.is_some() {}
        Ok(UniqueNames)
    }

    fn visit_bool<E>(self, _: bool) -> Result<UniqueNames, E> {
        Ok(UniqueNames)
    }
    fn visit_i64<E>(self, _: i64) -> Result<UniqueNames, E> {
        Ok(UniqueNames)
    }
    fn visit_u64<E>(self, _: u64) -> Result<UniqueNames, E> {
        Ok(UniqueNames)
    }
    fn visit_f64<E>(self, _: f64) -> Result<UniqueNames, E> {
        Ok(UniqueNames)
    }
    fn visit_str<E>(self, _: &str) -> Result<UniqueNames, E> {
        Ok(UniqueNames)
    }
    fn visit_unit<E>(self) -> Result<UniqueNames, E> {
        Ok(UniqueNames)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_repeated_at_any_depth_is_found_and_other_json_is_not() {
        for repeated in [
            r#"{"a":1,"a":2}"#,
            r#"{"a":{"b":1,"b":1}}"#,
            r#"[{"b":1,"b":2}]"#,
            r#"{"scope":"x","\u0073cope":"y"}"#,
        ] {
            assert!(repeats_a_name(repeated.as_bytes()), "{repeated}");
        }
        for fine in [
            r#"{"a":1,"A":2}"#,
            r#"[{"a":1},{"a":2}]"#,
            "{}",
            "7",
            "not json",
            "",
        ] {
            assert!(!repeats_a_name(fine.as_bytes()), "{fine}");
        }
    }
}
