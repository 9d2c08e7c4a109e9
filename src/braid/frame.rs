//! A framer for relaying a Braid upstream's 209 body: it finds where each
//! update begins and ends, and reads only what the proxy needs to index
//! it (status, `Version`, `Parents`), keeping the update's bytes as
//! received. It is as lenient as braid-http's client (`parse_headers`,
//! `parse_body` in braid-http-client.js): any number of CR/LF between
//! updates, `HTTP/1.1 200 OK`, `HTTP 200` or `200 OK` status lines and
//! `:status` headers, header lines it cannot read, `Content-Length` before
//! `Patches: N` or `Content-Type: application/http-patches; count=N`, any
//! range unit and any content. What it cannot frame is the caller's to pass
//! through unframed.

use bytes::{Bytes, BytesMut};

use super::decode::trim;
use super::VersionList;

/// One framed update: its bytes as received, and what indexes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Framed {
    /// The update exactly as received, from its first header line to the
    /// end of its body (the blank lines before it are not included).
    pub raw: Bytes,
    pub status: Option<u16>,
    /// `None` when the update has no `Version` header or it cannot be read.
    pub version: Option<VersionList>,
    pub parents: Option<VersionList>,
}

/// What the framer found next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// A blank line between updates (a heartbeat), as received.
    Blank(Bytes),
    Update(Framed),
}

/// Why the rest of a stream cannot be framed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("an update has neither Content-Length nor Patches")]
    NoLength,
    #[error("a patch has no Content-Length")]
    PatchWithoutLength,
    #[error("an update is larger than {0} bytes")]
    TooLarge(usize),
}

/// The framer; feed it bytes with [`Framer::push`], take pieces with [`Framer::next`].
#[derive(Debug)]
pub struct Framer {
    buf: BytesMut,
    max_update: usize,
}

impl Framer {
    /// A framer that gives up on an update over `max_update` bytes.
    pub fn new(max_update: usize) -> Framer {
        Framer {
            buf: BytesMut::new(),
            max_update,
        }
    }

    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Everything buffered and not framed, for passing through.
    pub fn take_rest(&mut self) -> Bytes {
        self.buf.split().freeze()
    }

    /// The next piece, `Ok(None)` when more bytes are needed.
    pub fn next_piece(&mut self) -> Result<Option<Piece>, FrameError> {
        let blank = if self.buf.starts_with(b"\r\n") {
            2
        } else if self.buf.starts_with(b"\n") {
            1
        } else {
            0
        };
        if blank > 0 {
            return Ok(Some(Piece::Blank(self.buf.split_to(blank).freeze())));
        }
        if self.buf.is_empty() || self.buf.as_ref() == b"\r" {
            return Ok(None);
        }
        match frame(&self.buf)? {
            Some((mut framed, used)) => {
                framed.raw = self.buf.split_to(used).freeze();
                Ok(Some(Piece::Update(framed)))
            }
            None if self.buf.len() > self.max_update => Err(FrameError::TooLarge(self.max_update)),
            None => Ok(None),
        }
    }
}

/// The headers of one block, lower-cased names, and the bytes it took.
struct Block {
    status: Option<u16>,
    headers: Vec<(String, Bytes)>,
    used: usize,
}

impl Block {
    fn get(&self, name: &str) -> Option<&[u8]> {
        // The last one wins, as in braid-http's `headers[name] = value`.
        self.headers
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// Reads one header block at the start of `buf`, or `None` if incomplete.
fn block(buf: &[u8]) -> Option<Block> {
    let mut pos = 0;
    let mut status = None;
    let mut headers = Vec::new();
    let mut first = true;
    loop {
        let nl = buf[pos..].iter().position(|&b| b == b'\n')?;
        let line = &buf[pos..pos + nl];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        pos += nl + 1;
        if line.is_empty() {
            return Some(Block {
                status,
                headers,
                used: pos,
            });
        }
        if std::mem::take(&mut first) {
            if let Some(code) = status_line(line) {
                status = Some(code);
                continue;
            }
        }
        // `name: value`; a pseudo-header keeps its leading colon.
        let from = usize::from(line.first() == Some(&b':'));
        let Some(colon) = line[from..].iter().position(|&b| b == b':') else {
            continue;
        };
        let name = String::from_utf8_lossy(&line[..from + colon]).to_ascii_lowercase();
        let value = trim(&line[from + colon + 1..]);
        if name == ":status" {
            status = leading_number(value).and_then(|n| u16::try_from(n).ok());
        }
        headers.push((name, Bytes::copy_from_slice(value)));
    }
}

/// The code of `HTTP/1.1 200 OK`, `HTTP 200 OK` or `200 OK`.
fn status_line(line: &[u8]) -> Option<u16> {
    let text = std::str::from_utf8(line).ok()?;
    let rest = match text.strip_prefix("HTTP") {
        Some(rest) => rest.split_once(' ')?.1,
        None => text,
    };
    let code = rest.get(..3)?;
    (code.bytes().all(|b| b.is_ascii_digit())
        && matches!(rest.as_bytes().get(3), None | Some(b' ')))
    .then(|| code.parse().ok())
    .flatten()
}

/// The leading digits of a value, as JavaScript's `parseInt` reads them.
fn leading_number(v: &[u8]) -> Option<usize> {
    let digits = v.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&v[..digits]).ok()?.parse().ok()
}

/// How many patches an update declares: `Patches: N`, or
/// `Content-Type: application/http-patches; count=N`.
fn declared_patches(b: &Block) -> Option<usize> {
    if let Some(v) = b.get("patches") {
        return leading_number(v);
    }
    let ct = String::from_utf8_lossy(b.get("content-type")?).to_ascii_lowercase();
    let (_, params) = ct.split_once("/http-patches")?;
    let (_, count) = params.split_once("count")?;
    leading_number(trim(count.trim_start().strip_prefix('=')?.as_bytes()))
}

/// One update at the start of `buf` and the bytes it takes, or `None` if incomplete.
fn frame(buf: &[u8]) -> Result<Option<(Framed, usize)>, FrameError> {
    let Some(head) = block(buf) else {
        return Ok(None);
    };
    let list = |name: &str| {
        head.get(name)
            .and_then(|v| VersionList::parse_named(v, "Version").ok())
    };
    let mut framed = Framed {
        raw: Bytes::new(),
        status: head.status,
        version: list("version"),
        parents: list("parents"),
    };
    let mut pos = head.used;
    if let Some(len) = head.get("content-length").and_then(leading_number) {
        pos = pos.saturating_add(len);
    } else if let Some(count) = declared_patches(&head) {
        for _ in 0..count {
            while matches!(buf.get(pos), Some(b'\r' | b'\n')) {
                pos += 1;
            }
            let Some(patch) = block(&buf[pos.min(buf.len())..]) else {
                return Ok(None);
            };
            let len = patch
                .get("content-length")
                .and_then(leading_number)
                .ok_or(FrameError::PatchWithoutLength)?;
            pos = pos.saturating_add(patch.used).saturating_add(len);
            if pos > buf.len() {
                return Ok(None);
            }
        }
    } else {
        return Err(FrameError::NoLength);
    }
    if pos > buf.len() {
        return Ok(None);
    }
    framed.raw = Bytes::copy_from_slice(&buf[..pos]);
    Ok(Some((framed, pos)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(input: &[u8], step: usize) -> Vec<Piece> {
        let mut f = Framer::new(1 << 20);
        let mut out = Vec::new();
        for chunk in input.chunks(step) {
            f.push(chunk);
            while let Some(p) = f.next_piece().expect("frames") {
                out.push(p);
            }
        }
        assert_eq!(f.take_rest().len(), 0);
        out
    }

    #[test]
    fn frames_what_braid_http_reads_under_any_chunking() {
        let input: &[u8] = b"HTTP 200 OK\r\nVersion: \"b\", \"a\"\r\nParents: \"z\", \"y\"\r\nX-Extra: 1\r\nContent-Length: 3\r\n\r\nabc\r\n\n\
:status: 404\nVersion: \"c\"\nContent-Type: application/http-patches; count=2\n\n\
Content-Length: 1\nContent-Range: json .a\n\nx\n\nContent-Length: 2\nContent-Range: bytes [0:0]\n\n\x00\xff\
200 OK\r\nVersion: \r\nPatches: 0\r\n\r\n";
        for step in [1, 2, 7, input.len()] {
            let pieces = all(input, step);
            let updates: Vec<&Framed> = pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::Update(u) => Some(u),
                    Piece::Blank(_) => None,
                })
                .collect();
            assert_eq!(updates.len(), 3, "step {step}");
            assert_eq!(updates[0].status, Some(200));
            assert!(updates[0].raw.ends_with(b"abc"));
            assert_eq!(
                updates[0].parents.as_ref().map(|p| p.to_header_value()),
                Some("\"y\", \"z\"".to_string())
            );
            assert_eq!(updates[1].status, Some(404));
            assert!(updates[1].raw.ends_with(b"\x00\xff"));
            assert_eq!(updates[2].version, Some(VersionList::default()));
            let total: usize = pieces
                .iter()
                .map(|p| match p {
                    Piece::Update(u) => u.raw.len(),
                    Piece::Blank(b) => b.len(),
                })
                .sum();
            assert_eq!(total, input.len(), "every byte is kept, step {step}");
        }
    }

    #[test]
    fn what_has_no_length_is_not_framed() {
        let mut f = Framer::new(1024);
        f.push(b"Version: \"a\"\r\n\r\nrest");
        assert_eq!(f.next_piece(), Err(FrameError::NoLength));
        assert_eq!(&f.take_rest()[..], b"Version: \"a\"\r\n\r\nrest");
    }
}
