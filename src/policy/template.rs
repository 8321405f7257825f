//! Action templates (`path`, `body`, `headers`): literal text with `{column}` placeholders
//! filled from the item's row.

use crate::policy::Ident;

/// Splits a template into literal text and `{column}` placeholders. A placeholder is `{`, an
/// identifier (letters, digits, `_`, `$`, starting with a letter or `_`), `}`; every other brace
/// is literal text, so JSON bodies need no escaping.
pub(crate) fn pieces(template: &str) -> Vec<(&str, bool)> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let name_len = after
            .bytes()
            .take_while(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'$')
            .count();
        let starts_ok = after
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
        if starts_ok && after.as_bytes().get(name_len) == Some(&b'}') {
            out.push((&rest[..open], false));
            out.push((&after[..name_len], true));
            rest = &after[name_len + 1..];
        } else {
            out.push((&rest[..open + 1], false));
            rest = after;
        }
    }
    out.push((rest, false));
    out
}

/// The `{column}` placeholders of a template, in order.
pub fn placeholders(template: &str) -> Result<Vec<Ident>, String> {
    pieces(template)
        .into_iter()
        .filter(|(_, p)| *p)
        .map(|(name, _)| Ident::parse(name).map_err(|e| format!("`{template}`: placeholder {e}")))
        .collect()
}
