//! An incremental decoder for the body of a 209 response: feed it chunks
//! as they arrive, take updates out as they complete. It accepts any
//! chunking, CRLF or bare LF, blank lines between updates (heartbeats),
//! optional status lines and `Patches: N` blocks. Every buffer is bounded
//! by [`DecodeLimits`]; going over one is a typed error.

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderName, HeaderValue};

use super::{Body, Patch, RangeUnit, Update, VersionList};

/// Bounds on what one update may hold.
#[derive(Debug, Clone, Copy)]
pub struct DecodeLimits {
    /// Largest header block (status line and headers) of an update or patch.
    pub max_header_block: usize,
    /// Largest body of an update, all patches together.
    pub max_content_length: usize,
    /// Most patches in one update.
    pub max_patches: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_header_block: 64 * 1024,
            max_content_length: 64 * 1024 * 1024,
            max_patches: super::MAX_PATCHES,
        }
    }
}

/// What was wrong with a subscription stream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("update header block is larger than {limit} bytes")]
    HeaderBlockTooLarge { limit: usize },
    #[error("update body of {length} bytes is larger than the limit of {limit}")]
    ContentLengthTooLarge { length: usize, limit: usize },
    #[error("update has {count} patches, more than the limit of {limit}")]
    TooManyPatches { count: usize, limit: usize },
    #[error("update or patch has no Content-Length")]
    MissingContentLength,
    #[error("malformed {name} header: {reason}")]
    BadHeader { name: String, reason: String },
    #[error("malformed status line in an update")]
    BadStatusLine,
    #[error("malformed Content-Range: {0}")]
    BadContentRange(String),
    #[error("unknown range unit {0}")]
    UnknownUnit(String),
    /// A request's body ends before its `Patches: N` are complete.
    #[error("Patches: {declared} but the body holds {found} complete patches")]
    TooFewPatches { declared: usize, found: usize },
    /// A request's body goes on after its `Patches: N`.
    #[error("Patches: {declared} but the body holds more after the last one")]
    TooManyInBody { declared: usize },
}

/// The decoder; see the module docs.
#[derive(Debug)]
pub struct Decoder {
    buf: BytesMut,
    limits: DecodeLimits,
    heartbeats: u64,
}

impl Decoder {
    pub fn new(limits: DecodeLimits) -> Decoder {
        Decoder {
            buf: BytesMut::new(),
            limits,
            heartbeats: 0,
        }
    }

    /// Adds bytes received from the stream.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Blank lines seen between updates.
    pub fn heartbeats_seen(&self) -> u64 {
        self.heartbeats
    }

    /// Bytes buffered and not yet decoded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete update, `Ok(None)` when more bytes are needed.
    pub fn next_update(&mut self) -> Result<Option<Update>, DecodeError> {
        // Blank lines between updates are heartbeats.
        loop {
            if self.buf.starts_with(b"\r\n") {
                self.buf.advance(2);
            } else if self.buf.starts_with(b"\n") {
                self.buf.advance(1);
            } else if self.buf.as_ref() == b"\r" {
                return Ok(None);
            } else {
                break;
            }
            self.heartbeats += 1;
        }
        if self.buf.is_empty() {
            return Ok(None);
        }
        match parse_update(&self.buf, &self.limits)? {
            Some((update, used)) => {
                self.buf.advance(used);
                Ok(Some(update))
            }
            None => {
                // Nothing complete: what is buffered must still fit the limits.
                let bound = self.limits.max_header_block * (self.limits.max_patches + 1)
                    + self.limits.max_content_length;
                if self.buf.len() > bound {
                    return Err(DecodeError::HeaderBlockTooLarge {
                        limit: self.limits.max_header_block,
                    });
                }
                Ok(None)
            }
        }
    }
}

/// A header block: (status, headers) and the bytes it took, blank line included.
type Block = (Option<u16>, Vec<(String, Bytes)>, usize);

/// Splits off one header block, or `None` when it is not complete yet.
fn header_block(
    buf: &[u8],
    limit: usize,
    allow_status: bool,
) -> Result<Option<Block>, DecodeError> {
    let mut pos = 0;
    let mut status = None;
    let mut headers = Vec::new();
    loop {
        let Some(nl) = buf[pos..].iter().position(|&b| b == b'\n') else {
            if buf.len() > limit {
                return Err(DecodeError::HeaderBlockTooLarge { limit });
            }
            return Ok(None);
        };
        let line = &buf[pos..pos + nl];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        pos += nl + 1;
        if pos > limit {
            return Err(DecodeError::HeaderBlockTooLarge { limit });
        }
        if line.is_empty() {
            return Ok(Some((status, headers, pos)));
        }
        // `HTTP/1.1 200 OK`, or `HTTP 200 OK` as braid-http's server writes it.
        let status_line = line.starts_with(b"HTTP/") || line.starts_with(b"HTTP ");
        if allow_status && headers.is_empty() && status.is_none() && status_line {
            status = Some(parse_status(line)?);
            continue;
        }
        let colon = line
            .iter()
            .position(|&b| b == b':')
            .ok_or_else(|| DecodeError::BadHeader {
                name: String::from_utf8_lossy(line).chars().take(40).collect(),
                reason: "a header line without a colon".into(),
            })?;
        let name = std::str::from_utf8(&line[..colon])
            .ok()
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_graphic()))
            .ok_or_else(|| DecodeError::BadHeader {
                name: "(header name)".into(),
                reason: "not a token".into(),
            })?
            .to_ascii_lowercase();
        let value = trim(&line[colon + 1..]);
        headers.push((name, Bytes::copy_from_slice(value)));
    }
}

/// `v` without leading and trailing ASCII whitespace.
pub(super) fn trim(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &v[start..end]
}

fn parse_status(line: &[u8]) -> Result<u16, DecodeError> {
    let text = std::str::from_utf8(line).map_err(|_| DecodeError::BadStatusLine)?;
    let mut parts = text.split_whitespace();
    let _protocol = parts.next();
    let code: u16 = parts
        .next()
        .and_then(|c| c.parse().ok())
        .ok_or(DecodeError::BadStatusLine)?;
    if !(100..=999).contains(&code) {
        return Err(DecodeError::BadStatusLine);
    }
    Ok(code)
}

fn find<'a>(headers: &'a [(String, Bytes)], name: &str) -> Option<&'a Bytes> {
    headers.iter().find(|(n, _)| n == name).map(|(_, v)| v)
}

fn number(headers: &[(String, Bytes)], name: &str) -> Result<Option<usize>, DecodeError> {
    match find(headers, name) {
        None => Ok(None),
        Some(v) => std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.parse().ok())
            .map(Some)
            .ok_or_else(|| DecodeError::BadHeader {
                name: name.into(),
                reason: "not a number".into(),
            }),
    }
}

/// Parses a `Content-Range` value of a patch: `<unit> <range>`, e.g. `text [5:5]`.
pub fn parse_content_range(v: &[u8]) -> Result<(RangeUnit, String), DecodeError> {
    let text =
        std::str::from_utf8(v).map_err(|_| DecodeError::BadContentRange("not ASCII".into()))?;
    let (unit, range) = text
        .trim()
        .split_once(' ')
        .ok_or_else(|| DecodeError::BadContentRange(text.into()))?;
    let unit = match unit {
        "text" => RangeUnit::Text,
        "bytes" => RangeUnit::Bytes,
        "json" => RangeUnit::Json,
        other => return Err(DecodeError::UnknownUnit(other.chars().take(40).collect())),
    };
    Ok((unit, range.trim().to_string()))
}

/// One patch of a `Patches: N` block starting at `pos` (blank lines before
/// it are skipped): the patch and where it ends, `Ok(None)` when `buf`
/// ends first. `total` adds up the patches' lengths against the limit.
fn next_patch(
    buf: &[u8],
    mut pos: usize,
    limits: &DecodeLimits,
    total: &mut usize,
) -> Result<Option<(Patch, usize)>, DecodeError> {
    while buf.get(pos) == Some(&b'\r') || buf.get(pos) == Some(&b'\n') {
        pos += 1;
    }
    let Some((_, sub, used)) = header_block(&buf[pos..], limits.max_header_block, false)? else {
        return Ok(None);
    };
    let len = number(&sub, "content-length")?.ok_or(DecodeError::MissingContentLength)?;
    *total = total.saturating_add(len);
    if *total > limits.max_content_length {
        return Err(DecodeError::ContentLengthTooLarge {
            length: *total,
            limit: limits.max_content_length,
        });
    }
    let range = find(&sub, "content-range")
        .ok_or_else(|| DecodeError::BadContentRange("a patch has no Content-Range".into()))?;
    let (unit, range) = parse_content_range(range)?;
    let start = pos + used;
    if buf.len() < start + len {
        return Ok(None);
    }
    let patch = Patch {
        unit,
        range,
        content: Bytes::copy_from_slice(&buf[start..start + len]),
    };
    Ok(Some((patch, start + len)))
}

/// Decodes the body of a request that carried `Patches: count`: exactly
/// `count` patches, each with `Content-Length` and `Content-Range`, blank
/// lines between and after them and nothing else.
pub fn decode_patches(
    body: &[u8],
    count: usize,
    limits: &DecodeLimits,
) -> Result<Vec<Patch>, DecodeError> {
    if count > limits.max_patches {
        return Err(DecodeError::TooManyPatches {
            count,
            limit: limits.max_patches,
        });
    }
    let mut patches = Vec::with_capacity(count);
    let (mut pos, mut total) = (0, 0);
    while patches.len() < count {
        let Some((patch, end)) = next_patch(body, pos, limits, &mut total)? else {
            return Err(DecodeError::TooFewPatches {
                declared: count,
                found: patches.len(),
            });
        };
        patches.push(patch);
        pos = end;
    }
    if body[pos..].iter().any(|b| !matches!(b, b'\r' | b'\n')) {
        return Err(DecodeError::TooManyInBody { declared: count });
    }
    Ok(patches)
}

fn versions(headers: &[(String, Bytes)], name: &'static str) -> Result<VersionList, DecodeError> {
    match find(headers, &name.to_ascii_lowercase()) {
        None => Ok(VersionList::default()),
        Some(v) => VersionList::parse_named(v, name).map_err(|e| DecodeError::BadHeader {
            name: name.into(),
            reason: e.reason,
        }),
    }
}

/// Parses one update at the start of `buf`: `Ok(None)` when incomplete.
fn parse_update(buf: &[u8], limits: &DecodeLimits) -> Result<Option<(Update, usize)>, DecodeError> {
    let Some((status, headers, mut pos)) = header_block(buf, limits.max_header_block, true)? else {
        return Ok(None);
    };
    let version = versions(&headers, "Version")?;
    let parents = versions(&headers, "Parents")?;
    let mut extra_headers = Vec::new();
    for (name, value) in &headers {
        if matches!(
            name.as_str(),
            "version" | "parents" | "content-length" | "content-range" | "patches"
        ) {
            continue;
        }
        let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| DecodeError::BadHeader {
            name: name.clone(),
            reason: "not a header name".into(),
        })?;
        let value =
            HeaderValue::from_maybe_shared(value.clone()).map_err(|_| DecodeError::BadHeader {
                name: name.to_string(),
                reason: "not a header value".into(),
            })?;
        extra_headers.push((name, value));
    }
    let body = if let Some(count) = number(&headers, "patches")? {
        if count > limits.max_patches {
            return Err(DecodeError::TooManyPatches {
                count,
                limit: limits.max_patches,
            });
        }
        let mut patches = Vec::with_capacity(count);
        let mut total = 0usize;
        for _ in 0..count {
            let Some((patch, end)) = next_patch(buf, pos, limits, &mut total)? else {
                return Ok(None);
            };
            patches.push(patch);
            pos = end;
        }
        Body::Patches(patches)
    } else {
        let len = number(&headers, "content-length")?.ok_or(DecodeError::MissingContentLength)?;
        if len > limits.max_content_length {
            return Err(DecodeError::ContentLengthTooLarge {
                length: len,
                limit: limits.max_content_length,
            });
        }
        if buf.len() < pos + len {
            return Ok(None);
        }
        let content = Bytes::copy_from_slice(&buf[pos..pos + len]);
        pos += len;
        match find(&headers, "content-range") {
            Some(range) => {
                let (unit, range) = parse_content_range(range)?;
                Body::Patches(vec![Patch {
                    unit,
                    range,
                    content,
                }])
            }
            None => Body::Snapshot(content),
        }
    };
    Ok(Some((
        Update {
            status,
            version,
            parents,
            body,
            extra_headers,
        },
        pos,
    )))
}
