//! The Braid-HTTP wire protocol: version ids and lists, the request header
//! parsers, updates and patches, the update encoder, and patch application
//! and composition. Depends on nothing else of the crate. See spec/.

mod decode;
mod encode;
mod frame;
mod headers;
mod patch;
mod request;

pub use decode::{decode_patches, parse_content_range, DecodeError, DecodeLimits, Decoder};
pub use encode::{encode, encode_heartbeat, patches_wire_len};
pub use frame::{FrameError, Framed, Framer, Piece};
pub use headers::{
    heartbeats_upstream, is_stream, parse_heartbeats, parse_subscribe, HeaderError, VersionId,
    VersionList, MAX_HEARTBEAT, MAX_VERSIONS, MAX_VERSION_ID_LEN, MIN_HEARTBEAT,
};
pub use patch::{apply_patches, compose, PatchError};
pub use request::{answer_in_own_dialect, speak_upstream, BraidRequest};

use bytes::Bytes;

/// Most patches the proxy puts in one update, and accepts in one by default;
/// an update that would need more is sent as a snapshot.
pub const MAX_PATCHES: usize = 1024;

/// The unit a patch's range counts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeUnit {
    /// Unicode code points of UTF-8 text.
    Text,
    /// Bytes.
    Bytes,
    /// A JSON path (range-patch draft); carried, not applied, by the proxy.
    Json,
}

impl RangeUnit {
    pub fn as_str(self) -> &'static str {
        match self {
            RangeUnit::Text => "text",
            RangeUnit::Bytes => "bytes",
            RangeUnit::Json => "json",
        }
    }
}

/// One patch: replace `range` (in `unit`) of the document with `content`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Patch {
    pub unit: RangeUnit,
    /// `[a:b]` for text and bytes.
    pub range: String,
    pub content: Bytes,
}

impl Patch {
    /// A text patch replacing code points `start..end`.
    pub fn text(start: usize, end: usize, content: impl Into<Bytes>) -> Patch {
        Patch {
            unit: RangeUnit::Text,
            range: format!("[{start}:{end}]"),
            content: content.into(),
        }
    }

    /// A bytes patch replacing bytes `start..end`.
    pub fn bytes(start: usize, end: usize, content: impl Into<Bytes>) -> Patch {
        Patch {
            unit: RangeUnit::Bytes,
            range: format!("[{start}:{end}]"),
            content: content.into(),
        }
    }

    /// The `(start, end)` of a `[a:b]` range.
    pub fn span(&self) -> Option<(usize, usize)> {
        span_of(&self.range)
    }
}

/// The `(start, end)` of a `[a:b]` range with `a <= b`.
pub fn span_of(range: &str) -> Option<(usize, usize)> {
    let inner = range.trim().strip_prefix('[')?.strip_suffix(']')?;
    let (a, b) = inner.split_once(':')?;
    let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    (a <= b).then_some((a, b))
}

/// The content of an update.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// The whole document.
    Snapshot(Bytes),
    /// Patches against the parent version.
    Patches(Vec<Patch>),
}

/// One update in a subscription stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    /// A per-update status other than 200 (e.g. 404 for a deleted resource).
    pub status: Option<u16>,
    pub version: VersionList,
    pub parents: VersionList,
    pub body: Body,
    pub extra_headers: Vec<(http::HeaderName, http::HeaderValue)>,
}
