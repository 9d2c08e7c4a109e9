//! Whose view a session is: the relay key a request must share to join
//! one, the view key of its representation, and what marks a Braid server.

use http::HeaderMap;

use crate::floor::rules::{self, Vary};
use crate::state::Key;

/// Whether an answer carries a header only a Braid server sends: a Braid
/// header, or the marks braidify (braid-http's server) puts on every answer,
/// a plain GET's included: `Range-Request-Allow-Methods`,
/// `Range-Request-Allow-Units`, and a `Vary` naming `Version` or `Parents`
/// (a plain origin has no such request headers to vary by).
pub fn braid_signs(headers: &HeaderMap) -> bool {
    [
        "version",
        "current-version",
        "parents",
        "subscribe",
        "patches",
        "range-request-allow-methods",
        "range-request-allow-units",
    ]
    .iter()
    .any(|h| headers.contains_key(*h))
        || headers.get_all(http::header::VARY).iter().any(|line| {
            line.to_str().is_ok_and(|line| {
                line.split(',').map(str::trim).any(|name| {
                    name.eq_ignore_ascii_case("version") || name.eq_ignore_ascii_case("parents")
                })
            })
        })
}

/// The key under which requests share a session: the resource variant
/// (host, path, the `Vary`'d values, credentials), plus `Accept`,
/// `Accept-Encoding` and the Braid request headers but `Parents` (where a
/// request starts is decided by the window).
pub fn relay_key(key: &Key, headers: &HeaderMap) -> String {
    let mut out = view_key(key, headers);
    add_values(
        &mut out,
        headers,
        &["peer", "merge-type", "subscribe", "heartbeats", "version"],
    );
    out
}

/// The key of the representation a request gets: its variant and its
/// content negotiation (`Accept`, `Accept-Encoding`); the relay key is
/// this plus the Braid request headers.
pub(super) fn view_key(key: &Key, headers: &HeaderMap) -> String {
    let mut out = format!("{}\n{}", key.path, key.secondary);
    add_values(&mut out, headers, &["accept", "accept-encoding"]);
    out
}

/// Appends a `name:values` line for each of `names`, the values byte for
/// byte ([`rules::push_field`]).
pub(super) fn add_values(out: &mut String, headers: &HeaderMap, names: &[&str]) {
    for name in names {
        out.push('\n');
        out.push_str(name);
        out.push(':');
        rules::push_field(out, name, headers.get_all(*name));
    }
}

/// A 209's `Vary` without Braid's own request headers (braid-http's
/// server names `Version, Parents, Subscribe`), which every relay key has.
pub(super) fn subscription_vary(headers: &HeaderMap) -> Vary {
    match rules::vary(headers) {
        Vary::Names(names) => {
            let names: Vec<_> = names
                .into_iter()
                .filter(|n| !matches!(n.as_str(), "version" | "parents" | "subscribe"))
                .collect();
            if names.is_empty() {
                Vary::None
            } else {
                Vary::Names(names)
            }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn the_key_tells_requests_apart_by_what_the_upstream_may_answer_differently() {
        let key = Key {
            path: "/doc".into(),
            secondary: "host".into(),
            vary: Default::default(),
        };
        let with = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.insert(*n, http::HeaderValue::from_static(v));
            }
            relay_key(&key, &h)
        };
        let base = with(&[("subscribe", "true")]);
        assert_eq!(base, with(&[("subscribe", "true"), ("parents", "\"v1\"")]));
        assert_eq!(base, with(&[("subscribe", "true"), ("x-other", "1")]));
        for other in [
            ("accept", "text/plain"),
            ("peer", "p"),
            ("merge-type", "simpleton"),
            ("heartbeats", "5s"),
            ("version", "\"v1\""),
            ("accept-encoding", "gzip"),
        ] {
            assert_ne!(base, with(&[("subscribe", "true"), other]), "{other:?}");
        }
        assert_ne!(base, with(&[("subscribe", "?1")]));
    }
}
