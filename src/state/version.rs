//! Versions of a polled resource: the one the origin announced, or the
//! one the proxy derives (a strong ETag, else a hash of the content), and
//! the `Repr-Digest` of a body.

use base64::Engine;
use http::HeaderMap;
use sha2::{Digest, Sha256};

use super::said::State;
use crate::braid::{self, VersionId, VersionList};

/// Whether two states are one representation under one strong ETag.
pub(super) fn same_strong(a: &State, b: &State) -> bool {
    match (a, b) {
        (
            State::Present {
                body: a_body,
                content_type: a_type,
                etag: Some(a_tag),
                ..
            },
            State::Present {
                body: b_body,
                content_type: b_type,
                etag: Some(b_tag),
                ..
            },
        ) => {
            strong_etag(a_tag).is_some_and(|a| Some(a) == strong_etag(b_tag))
                && a_body == b_body
                && a_type == b_type
        }
        _ => false,
    }
}

/// The version the proxy derives for a state it is not told the version
/// of: the strong ETag, else a hash of the content.
pub fn derived_version(state: &State) -> VersionList {
    version_of(state).0
}

/// The version and digest of a state: the strong ETag when the origin gave
/// one, else a hash of the content (so two proxies derive the same id).
pub(super) fn version_of(state: &State) -> (VersionList, String) {
    let mut hasher = Sha256::new();
    match state {
        State::Present { body, .. } => hasher.update(body),
        State::Missing { status } => hasher.update(format!("status {status}")),
        State::Error { status, reason } => hasher.update(format!("status {status} {reason}")),
        // Named by its status alone: a denial whose body changes (a date
        // in it, say) is still the one denial.
        State::Denied { status, .. } => hasher.update(format!("status {status}")),
        State::Unknown => {}
    }
    let hash = hasher.finalize();
    // `Repr-Digest` covers the bytes sent: the body, the reason of an
    // error, nothing for a missing resource.
    let digest = match state {
        State::Present { .. } => format_digest(&hash),
        State::Denied { body, .. } => repr_digest(body),
        State::Error { reason, .. } => repr_digest(format!("{reason}\n").as_bytes()),
        _ => repr_digest(b""),
    };
    let strong = match state {
        State::Present {
            etag: Some(etag), ..
        } => strong_etag(etag),
        _ => None,
    };
    let version = match strong {
        Some(id) => VersionId::new(id)
            .map(VersionList::single)
            .unwrap_or_default(),
        None => hash_id(state, &hash),
    };
    (version, digest)
}

/// The version a state's content names, whatever its ETag says: for a
/// body the origin sent under the ETag of another.
pub(super) fn hashed_version(state: &State) -> VersionList {
    let mut hasher = Sha256::new();
    if let State::Present { body, .. } = state {
        hasher.update(body);
    }
    hash_id(state, &hasher.finalize())
}

fn hash_id(state: &State, hash: &[u8]) -> VersionList {
    let short = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&hash[..16]);
    let id = match state {
        State::Present { .. } => format!("h-{short}"),
        _ => format!("s-{short}"),
    };
    VersionId::new(id)
        .map(VersionList::single)
        .unwrap_or_default()
}

/// The version a 200 announces in its headers: a Braid server's `Version`,
/// else the strong ETag; `None` when it is known only from the body.
pub fn announced_version(headers: &HeaderMap) -> Option<VersionList> {
    if let Some(v) = headers
        .get("version")
        .and_then(|v| VersionList::parse_named(v.as_bytes(), "Version").ok())
        .filter(|v| !v.is_empty())
    {
        return Some(v);
    }
    let etag = headers.get(http::header::ETAG)?.to_str().ok()?;
    VersionId::new(strong_etag(etag)?)
        .ok()
        .map(VersionList::single)
}

/// The `Repr-Digest` value of a body: `sha-256=:<base64>:`.
pub fn repr_digest(body: &[u8]) -> String {
    format_digest(&Sha256::digest(body))
}

fn format_digest(hash: &[u8]) -> String {
    format!(
        "sha-256=:{}:",
        base64::engine::general_purpose::STANDARD.encode(hash)
    )
}

/// The opaque value of a strong ETag (`"abc"` → `abc`); `None` for weak or malformed ones.
pub fn strong_etag(etag: &str) -> Option<String> {
    let inner = etag.trim().strip_prefix('"')?.strip_suffix('"')?;
    let valid = !inner.is_empty()
        && inner.len() <= braid::MAX_VERSION_ID_LEN
        && inner
            .bytes()
            .all(|b| b == 0x21 || (0x23..=0x7e).contains(&b));
    valid.then(|| inner.to_string())
}
