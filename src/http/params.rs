//! Path and query parameters read in sweeper's words: every refusal is a 400 problem that names
//! the parameter and what it accepts, never a library's message.
//!
//! A query names only the parameters its endpoint accepts, each at most once (a repeated one
//! would be read by one parser as the first and by another as the last); its value must be
//! valid UTF-8 after percent-decoding and of the parameter's type.

use std::collections::HashSet;

use axum::extract::rejection::PathRejection;
use axum::extract::{FromRequestParts, MatchedPath, Path, Query};
use axum::http::request::Parts;
use axum::http::{StatusCode, Uri};
use serde::de::DeserializeOwned;

use super::Problem;

/// A query string's parameters: each name the endpoint accepts and what it accepts, in words
/// ("an integer from 1 to 500"). Every field of the type is optional, so one parameter can be
/// read alone to tell which one is wrong.
pub trait QueryParams: DeserializeOwned {
    /// `(name, what it accepts)` for every parameter.
    const ACCEPTS: &'static [(&'static str, &'static str)];
}

/// The query of an endpoint that takes no parameters: any parameter is refused by name.
#[derive(Debug, serde::Deserialize)]
pub struct NoQuery {}

impl QueryParams for NoQuery {
    const ACCEPTS: &'static [(&'static str, &'static str)] = &[];
}

/// The query of a request, read by [`QueryParams::ACCEPTS`]'s rules.
pub struct Params<T>(pub T);

impl<S: Send + Sync, T: QueryParams> FromRequestParts<S> for Params<T> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        read_query::<T>(parts.uri.query().unwrap_or("")).map(Params)
    }
}

fn bad_query(detail: String) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, "bad-query", detail)
}

/// A percent-encoded form component (`+` is a space), as UTF-8.
fn decoded(component: &str) -> Option<String> {
    let spaced = component.replace('+', " ");
    percent_encoding::percent_decode_str(&spaced)
        .decode_utf8()
        .ok()
        .map(|s| s.into_owned())
}

fn accepted<T: QueryParams>() -> String {
    T::ACCEPTS
        .iter()
        .map(|(n, _)| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads `query` as `T`: unknown, repeated or mistyped parameters are refused by name.
pub fn read_query<T: QueryParams>(query: &str) -> Result<T, Problem> {
    let mut seen = HashSet::new();
    for piece in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = piece.split_once('=').unwrap_or((piece, ""));
        let name = decoded(name).ok_or_else(|| {
            bad_query("a parameter's name is not valid UTF-8 after percent-decoding".into())
        })?;
        let Some((name, accepts)) = T::ACCEPTS.iter().find(|(n, _)| *n == name) else {
            let none = T::ACCEPTS.is_empty();
            return Err(bad_query(if none {
                format!(
                    "unknown parameter `{}`: this endpoint takes no query parameters",
                    crate::ledger::printable(&name, 64)
                )
            } else {
                format!(
                    "unknown parameter `{}`: this endpoint accepts {}",
                    crate::ledger::printable(&name, 64),
                    accepted::<T>()
                )
            }));
        };
        if !seen.insert(*name) {
            return Err(bad_query(format!(
                "`{name}` is given more than once; give it once"
            )));
        }
        if decoded(value).is_none() {
            return Err(bad_query(format!(
                "`{name}` is not valid UTF-8 after percent-decoding; it must be {accepts}"
            )));
        }
        let alone = Uri::try_from(format!("/?{piece}"))
            .ok()
            .and_then(|uri| Query::<T>::try_from_uri(&uri).ok());
        if alone.is_none() {
            return Err(bad_query(format!("`{name}` must be {accepts}")));
        }
    }
    Uri::try_from(format!("/?{query}"))
        .ok()
        .and_then(|uri| Query::<T>::try_from_uri(&uri).ok())
        .map(|Query(t)| t)
        .ok_or_else(|| {
            bad_query(format!(
                "the query is not one this endpoint reads; it accepts {}",
                accepted::<T>()
            ))
        })
}

/// The path parameters of a request; a refusal names the parameter and what it accepts.
pub struct Segments<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Segments<T> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        use axum::extract::path::ErrorKind;
        let template = parts
            .extensions
            .get::<MatchedPath>()
            .map(|m| m.as_str().to_string())
            .unwrap_or_default();
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(t)) => Ok(Segments(t)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => {
                // A single parameter's error names no key: it is the template's only one.
                let only = template
                    .rsplit_once('{')
                    .and_then(|(_, k)| k.split_once('}'))
                    .map_or("path", |(k, _)| k)
                    .to_string();
                let key = match e.kind() {
                    ErrorKind::InvalidUtf8InPathParam { key } => {
                        return Err(bad_path(format!(
                            "`{key}` is not valid UTF-8 after percent-decoding; it must be {}",
                            segment_accepts(key)
                        )));
                    }
                    ErrorKind::ParseErrorAtKey { key, .. }
                    | ErrorKind::DeserializeError { key, .. } => key.clone(),
                    _ => only,
                };
                Err(bad_path(format!(
                    "`{key}` must be {}",
                    segment_accepts(&key)
                )))
            }
            Err(e) => Err(Problem::internal(format!(
                "path parameters of {template}: {e}"
            ))),
        }
    }
}

fn bad_path(detail: String) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, "bad-path", detail)
}

/// What each path parameter of [`super::ROUTES`] accepts.
fn segment_accepts(key: &str) -> &'static str {
    match key {
        "policy" => "a policy name",
        "run_id" => "a run id, `{policy}:{window}`",
        "id" => "a dead letter id, an integer",
        "key" => "the record's key as text",
        _ => "a value this endpoint accepts",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Q {
        limit: Option<i64>,
        policy: Option<String>,
        dry_run: Option<bool>,
    }

    impl QueryParams for Q {
        const ACCEPTS: &'static [(&'static str, &'static str)] = &[
            ("limit", "an integer from 1 to 500"),
            ("policy", "a policy name"),
            ("dry_run", "`true` or `false`"),
        ];
    }

    fn refusal(q: &str) -> String {
        read_query::<Q>(q).unwrap_err().detail().to_string()
    }

    #[test]
    fn each_refusal_names_the_parameter_and_what_it_accepts() {
        let q = read_query::<Q>("limit=5&policy=a%20b&dry_run=true").unwrap();
        assert_eq!(
            (q.limit, q.policy.as_deref(), q.dry_run),
            (Some(5), Some("a b"), Some(true))
        );
        assert!(read_query::<Q>("").is_ok());
        for (query, says) in [
            ("limit=abc", "`limit` must be an integer from 1 to 500"),
            ("limit=99999999999999999999", "`limit` must be an integer"),
            ("limit=", "`limit` must be an integer"),
            ("limit=1.5", "`limit` must be an integer"),
            ("dry_run=yes", "`dry_run` must be `true` or `false`"),
            ("limit=1&limit=2", "`limit` is given more than once"),
            ("limit=1&limit=1", "`limit` is given more than once"),
            (
                "lmit=1",
                "unknown parameter `lmit`: this endpoint accepts `limit`, `policy`, `dry_run`",
            ),
            ("policy=%FF%FE", "`policy` is not valid UTF-8"),
            ("%FF=1", "a parameter's name is not valid UTF-8"),
        ] {
            let detail = refusal(query);
            assert!(detail.contains(says), "{query}: {detail}");
            for library in ["Failed to deserialize", "invalid digit", "duplicate field"] {
                assert!(!detail.contains(library), "{query}: {detail}");
            }
        }
    }
}
