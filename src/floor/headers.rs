//! Header helpers every layer uses: copies that own their bytes, and the
//! hop-by-hop headers a proxy removes (RFC 9110 §7.6.1).

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// A copy of `headers` whose values own their bytes. hyper parses a
/// message's header values as slices of its connection's read buffer (8 or
/// 16 KiB), so a value kept after the message is gone keeps that whole
/// buffer alive: what is held long (a watcher's template, a stored answer,
/// a relayed head) is copied out.
pub fn owned_headers(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let Ok(mut copy) = HeaderValue::from_bytes(value.as_bytes()) else {
            continue;
        };
        copy.set_sensitive(value.is_sensitive());
        out.append(name.clone(), copy);
    }
    out
}

/// The header a braid-proxy names its purge feed with on answers to a tier
/// below (spec/tiers.md). It is about the hop it came over, so it is
/// removed with the hop-by-hop headers: each tier names its own feed.
pub const PURGE_FEED: &str = "purge-feed";

/// Removes the hop-by-hop headers: `Connection` and every header it names,
/// `Keep-Alive`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`, `Proxy-*`,
/// and the tiers' own [`PURGE_FEED`].
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        HeaderName::from_static(PURGE_FEED),
    ] {
        headers.remove(name);
    }
    let proxy: Vec<HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for name in proxy {
        headers.remove(name);
    }
}
