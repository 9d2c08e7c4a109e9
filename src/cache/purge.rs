//! Purging stored answers (the admin listener's `POST /purge`): by URL,
//! every variant; by tag, every stored answer whose `Surrogate-Key`
//! (space-separated) or `Cache-Tag` (comma-separated) names it. A purged
//! resource with subscribers is invalidated and re-fetched at once, so its
//! subscribers get the change; one without is forgotten, and the next GET
//! goes to the origin.

use std::sync::Arc;

use http::HeaderMap;

use crate::state::{Registry, Resource};

/// Longest tag header read per answer, in bytes; the rest is ignored.
const MAX_TAG_BYTES: usize = 16 * 1024;
/// Most tags read per answer.
const MAX_TAGS: usize = 1024;

/// What to purge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selector<'a> {
    /// Every variant of a path and query.
    Path(&'a str),
    /// Every stored answer that lists this tag.
    Tag(&'a str),
    /// Everything stored (a tier that may have missed purges from above,
    /// src/purges.rs).
    All,
}

/// The tags a stored answer lists in `Surrogate-Key` (separated by any
/// whitespace) and `Cache-Tag` (separated by commas), bounded in bytes and
/// count. A tag that is not visible ASCII is skipped alone.
pub fn tags(headers: &HeaderMap) -> Vec<&str> {
    let mut out = Vec::new();
    let mut bytes = 0;
    let lines = headers
        .get_all("surrogate-key")
        .iter()
        .map(|v| (v, true))
        .chain(headers.get_all("cache-tag").iter().map(|v| (v, false)));
    for (value, by_space) in lines {
        let value = value.as_bytes();
        bytes += value.len();
        if bytes > MAX_TAG_BYTES {
            break;
        }
        let split = |b: &u8| {
            if by_space {
                b.is_ascii_whitespace()
            } else {
                *b == b','
            }
        };
        for tag in value.split(split).map(<[u8]>::trim_ascii) {
            if tag.is_empty() || !tag.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
                continue;
            }
            if out.len() == MAX_TAGS {
                return out;
            }
            // Visible ASCII is UTF-8.
            if let Ok(tag) = std::str::from_utf8(tag) {
                out.push(tag);
            }
        }
    }
    out
}

/// Purges what `selector` names; returns how many resources (variants)
/// were purged.
pub fn purge(registry: &Registry, selector: Selector<'_>) -> usize {
    let chosen: Vec<Arc<Resource>> = match selector {
        // `/a` and `/a?` are one URL to a client, two keys here.
        Selector::Path(path) => {
            let bare = path.strip_suffix('?').unwrap_or(path);
            let mut all = registry.variants(bare);
            all.extend(registry.variants(&format!("{bare}?")));
            all
        }
        Selector::Tag(tag) => registry
            .every_variant()
            .into_iter()
            .filter(|r| r.stored().is_some_and(|s| tags(&s.headers).contains(&tag)))
            .collect(),
        Selector::All => registry.every_variant(),
    };
    for resource in &chosen {
        if resource.subscribers() > 0 {
            // Its subscribers get what the origin has now.
            resource.invalidate();
            resource.refresh();
        } else {
            resource.set_stored(None);
            registry.forget(resource);
        }
    }
    chosen.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn tags_from_both_headers() {
        let mut h = HeaderMap::new();
        h.append("surrogate-key", HeaderValue::from_static("  a  b "));
        h.append("surrogate-key", HeaderValue::from_static("c"));
        h.append("cache-tag", HeaderValue::from_static("d, e f,,g"));
        h.append("surrogate-key", HeaderValue::from_static("h\ti"));
        h.append(
            "surrogate-key",
            HeaderValue::from_bytes(b"j caf\xc3\xa9 k").expect("obs-text is a value"),
        );
        assert_eq!(
            tags(&h),
            vec!["a", "b", "c", "h", "i", "j", "k", "d", "e f", "g"]
        );
        let many = (0..2000)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(" ");
        let mut h = HeaderMap::new();
        h.insert(
            "surrogate-key",
            HeaderValue::from_str(&many).expect("value"),
        );
        assert_eq!(tags(&h).len(), MAX_TAGS);
        assert!(tags(&HeaderMap::new()).is_empty());
    }
}
