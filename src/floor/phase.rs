//! How a GET was answered, in one enum: the cache's phases. This proxy's
//! `Cache-Status` entry (RFC 9211) and the access log's `cache=` field are
//! both made from it, so they cannot disagree.

use std::fmt::Write as _;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response};

/// Why a request went to the origin (RFC 9211 §2.2 `fwd`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fwd {
    /// Nothing was known for the URL.
    UriMiss,
    /// The URL was known, not this variant (or nothing reusable of it).
    Miss,
    /// A stored answer was stale and revalidated, or replaced.
    Stale,
    /// The request could not be answered from the cache at all.
    Bypass,
}

impl Fwd {
    fn token(self) -> &'static str {
        match self {
            Fwd::UriMiss => "uri-miss",
            Fwd::Miss => "miss",
            Fwd::Stale => "stale",
            Fwd::Bypass => "bypass",
        }
    }
}

/// How a GET (or HEAD) was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CachePhase {
    /// From stored state, without the origin; `ttl` seconds of freshness left.
    Hit { ttl: i64 },
    /// From the model of a live upstream subscription of the same variant
    /// (the subscription counts as validation, spec/caching.md).
    Live,
    /// Stale (`ttl` <= 0) under `stale-while-revalidate`, without the
    /// origin; a revalidation runs in the background (RFC 5861 §3).
    StaleWhileRevalidate { ttl: i64 },
    /// From stored state after the origin answered 304 to a revalidation.
    Revalidated,
    /// From stored state instead of the origin's error (`fwd_status`, or
    /// none when no answer came) under `stale-if-error` (RFC 5861 §4).
    StaleIfError { fwd_status: Option<u16> },
    /// The origin's answer (`status`), stored on the way.
    Stored { fwd: Fwd, status: u16 },
    /// The origin's answer, not stored, for `reason`.
    NotStored {
        fwd: Fwd,
        status: u16,
        reason: &'static str,
    },
    /// Passed to the origin without looking at the cache (`no-store`,
    /// preconditions only the origin evaluates, a body on a GET).
    Bypass,
    /// A `Version` the proxy does not hold, asked of the origin and not stored.
    VersionNotHeld,
}

impl CachePhase {
    /// Its name in the access log.
    pub fn name(&self) -> &'static str {
        match self {
            CachePhase::Hit { .. } => "hit",
            CachePhase::Live => "live",
            CachePhase::StaleWhileRevalidate { .. } => "stale-while-revalidate",
            CachePhase::Revalidated => "revalidated",
            CachePhase::StaleIfError { .. } => "stale-if-error",
            CachePhase::Stored { .. } => "stored",
            CachePhase::NotStored { .. } => "not-stored",
            CachePhase::Bypass => "bypass",
            CachePhase::VersionNotHeld => "version-not-held",
        }
    }

    /// This proxy's `Cache-Status` entry, `"id"; ...`.
    pub fn header_value(&self, id: &str) -> Option<HeaderValue> {
        let mut v = String::with_capacity(id.len() + 48);
        let _ = write!(v, "\"{id}\"; ");
        let _ = match self {
            CachePhase::Hit { ttl } => write!(v, "hit; ttl={ttl}"),
            CachePhase::Live => write!(v, "hit; detail=\"live upstream subscription\""),
            CachePhase::StaleWhileRevalidate { ttl } => {
                write!(v, "hit; ttl={ttl}; detail=\"stale-while-revalidate\"")
            }
            CachePhase::Revalidated => write!(v, "fwd=stale; fwd-status=304"),
            CachePhase::StaleIfError {
                fwd_status: Some(s),
            } => {
                write!(v, "fwd=stale; fwd-status={s}; detail=\"stale-if-error\"")
            }
            CachePhase::StaleIfError { fwd_status: None } => {
                write!(v, "fwd=stale; detail=\"stale-if-error\"")
            }
            CachePhase::Stored { fwd, status } => {
                write!(v, "fwd={}; fwd-status={status}; stored", fwd.token())
            }
            CachePhase::NotStored {
                fwd,
                status,
                reason,
            } => write!(
                v,
                "fwd={}; fwd-status={status}; detail=\"not stored: {reason}\"",
                fwd.token()
            ),
            CachePhase::Bypass => write!(v, "fwd=bypass"),
            CachePhase::VersionNotHeld => write!(v, "fwd=miss; detail=\"version not held\""),
        };
        HeaderValue::from_maybe_shared(Bytes::from(v)).ok()
    }

    /// Appends its `Cache-Status` entry to `response` and records it there
    /// for the access log.
    pub fn mark<B>(self, mut response: Response<B>, id: &str) -> Response<B> {
        if let Some(v) = self.header_value(id) {
            response
                .headers_mut()
                .append(HeaderName::from_static("cache-status"), v);
        }
        response.extensions_mut().insert(self);
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_phase_has_its_entry_and_name() {
        let cases = [
            (CachePhase::Hit { ttl: 5 }, "\"p\"; hit; ttl=5", "hit"),
            (
                CachePhase::NotStored {
                    fwd: Fwd::UriMiss,
                    status: 200,
                    reason: "no-store",
                },
                "\"p\"; fwd=uri-miss; fwd-status=200; detail=\"not stored: no-store\"",
                "not-stored",
            ),
            (
                CachePhase::Stored {
                    fwd: Fwd::Stale,
                    status: 200,
                },
                "\"p\"; fwd=stale; fwd-status=200; stored",
                "stored",
            ),
            (CachePhase::Bypass, "\"p\"; fwd=bypass", "bypass"),
        ];
        for (phase, entry, name) in cases {
            assert_eq!(phase.header_value("p").unwrap(), entry);
            assert_eq!(phase.name(), name);
            let marked = phase.clone().mark(Response::new(()), "p");
            assert_eq!(marked.headers()["cache-status"], entry);
            assert_eq!(marked.extensions().get::<CachePhase>(), Some(&phase));
        }
    }
}
