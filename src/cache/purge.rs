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
}

/// The tags a stored answer lists in `Surrogate-Key` and `Cache-Tag`,
/// bounded in bytes and count.
pub fn tags(headers: &HeaderMap) -> Vec<&str> {
    let mut out = Vec::new();
    let mut bytes = 0;
    let lines = headers
        .get_all("surrogate-key")
        .iter()
        .map(|v| (v, ' '))
        .chain(headers.get_all("cache-tag").iter().map(|v| (v, ',')));
    for (value, separator) in lines {
        let Ok(text) = value.to_str() else { continue };
        bytes += text.len();
        if bytes > MAX_TAG_BYTES {
            break;
        }
        for tag in text
            .split(separator)
            .map(str::trim)
            .filter(|t| !t.is_empty())
        {
            if out.len() == MAX_TAGS {
                return out;
            }
            out.push(tag);
        }
    }
    out
}

/// Purges what `selector` names; returns how many resources (variants)
/// were purged.
pub fn purge(registry: &Registry, selector: Selector<'_>) -> usize {
    let chosen: Vec<Arc<Resource>> = match selector {
        Selector::Path(path) => registry.variants(path),
        Selector::Tag(tag) => registry
            .all()
            .into_iter()
            .filter(|r| r.stored().is_some_and(|s| tags(&s.headers).contains(&tag)))
            .collect(),
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
        assert_eq!(tags(&h), vec!["a", "b", "c", "d", "e f", "g"]);
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
