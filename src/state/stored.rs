//! The origin's last answer to a GET as the cache keeps it ([`Stored`]),
//! the answer headers prepared from it once, and what the answer said about
//! sharing ([`AnswerRules`]).

use std::sync::{Mutex, OnceLock};
use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};

use crate::braid::VersionList;
use crate::floor::rules::{Timing, Vary};

/// What an origin's answer says about who may share it: the request
/// headers it varies on, and whether it is one client's alone
/// (`private`, `no-store`, or it set a cookie).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerRules {
    pub vary: Vary,
    pub personal: bool,
}

/// What a header map holds: names, values, and a map entry's own cost.
pub fn header_bytes(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 48)
        .sum()
}

/// The origin's answer to a GET as a cache stores it (RFC 9111 §3): status,
/// end-to-end headers, body and timing. Plain GETs are answered from it.
#[derive(Debug, Clone)]
pub struct Stored {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub timing: Timing,
    /// The Braid version of this body when it is also the resource's head.
    pub version: Option<VersionList>,
    /// Set by an unsafe request or the refresh hook: revalidate before reuse.
    pub invalid: bool,
    /// The headers of a plain GET answered from it, built on its first hit
    /// ([`crate::serve::subscribe::serve_stored`]).
    pub prepared: Memo<Prepared>,
    /// What its own headers say about its freshness, computed on first use.
    pub freshness: Memo<crate::floor::rules::Freshness>,
}

impl Stored {
    /// [`crate::floor::rules::reuse`] for this stored answer.
    pub fn reuse(
        &self,
        request: &crate::floor::rules::CacheControl,
        now: SystemTime,
    ) -> crate::floor::rules::Reuse {
        crate::floor::rules::reuse_known(self.freshness(), request, now)
    }

    /// What its own headers say about its freshness.
    pub fn freshness(&self) -> &crate::floor::rules::Freshness {
        self.freshness.get_or_init(|| {
            crate::floor::rules::Freshness::of(self.status, &self.headers, self.timing)
        })
    }
}

/// What every hit on one stored answer shares: its response headers with
/// the values of the request that built them for `Age` and the last
/// `Cache-Status` entry, which each hit sets in place (same positions, so
/// the same bytes as building them anew).
#[derive(Debug)]
pub struct Prepared {
    pub headers: HeaderMap,
    /// The `ETag` answered (the origin's, or one made from the version).
    pub etag: Option<String>,
    /// The `Cache-Status` name these headers were built for.
    pub cache_id: String,
    /// The head's `Repr-Digest` when built with the Braid headers (the body
    /// was the head's), `None` when built without them.
    pub digest: Option<String>,
    /// The `Age` and `Cache-Status` values of the last hit, with the age and
    /// ttl they say: the hits of the same second share them.
    pub last_hit: Mutex<Option<(u64, i64, HeaderValue, HeaderValue)>>,
}

/// A value built at most once from what holds it. A clone starts empty:
/// clones of a [`Stored`] are made to be changed.
pub struct Memo<T>(OnceLock<T>);

impl<T> Memo<T> {
    pub fn get_or_init(&self, f: impl FnOnce() -> T) -> &T {
        self.0.get_or_init(f)
    }
}

impl<T> Default for Memo<T> {
    fn default() -> Self {
        Memo(OnceLock::new())
    }
}

impl<T> Clone for Memo<T> {
    fn clone(&self) -> Self {
        Memo::default()
    }
}

impl<T> std::fmt::Debug for Memo<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "Memo(built)"
        } else {
            "Memo(empty)"
        })
    }
}
