//! A framer for relaying a Braid upstream's 209 body: it finds where each
//! update begins and ends, checks that it is well formed, and reads only
//! what the proxy needs to index it (status, `Version`, `Parents`), keeping
//! the update's bytes as received. It accepts the framings braid-http's
//! client reads (`parse_headers`, `parse_body` in braid-http-client.js): any
//! number of CR/LF between updates, `HTTP/1.1 200 OK`, `HTTP 200` or
//! `200 OK` status lines and `:status` headers, `Content-Length` before
//! `Patches: N` or `Content-Type: application/http-patches; count=N`, any
//! range unit. What is malformed (a header line without a colon, a value
//! with control bytes, an unreadable `Version`, `Parents` or length, a
//! text or byte range that is not `[a:b]` with a <= b) is an error: the
//! caller ends that upstream subscription rather than relay it. An update
//! head that is not `name: value` lines but holds no control bytes comes
//! back whole in the error ([`FrameError::Unreadable`]), for the caller to
//! hand on as the stream's last bytes (spec/braid-wire.md §10.3).
//!
//! Framing is linear in the bytes received: the framer remembers how far
//! it has read the update at the front of its buffer (the block being read,
//! where its current line starts), so that bytes that come one at a time
//! are each looked at once. Every header block is bounded.

use bytes::{Buf, Bytes, BytesMut};

use super::decode::trim;
use super::VersionList;

/// Read-buffer capacity a framer keeps between updates; more is freed.
const IDLE_CAPACITY: usize = 64 * 1024;

/// One framed update: its bytes as received, and what indexes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Framed {
    /// The update exactly as received, from its first header line to the
    /// end of its body (the blank lines before it are not included).
    pub raw: Bytes,
    pub status: Option<u16>,
    /// `None` when the update has no `Version` header.
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
    #[error("a header block is larger than {0} bytes")]
    HeaderBlockTooLarge(usize),
    #[error("malformed update: {0}")]
    Malformed(String),
    /// An update's header block that is not `name: value` lines, and has
    /// no control bytes but CR, LF and tab: `block` is the whole block as
    /// received (blank line included), so that a relay can hand it on as
    /// the stream's last bytes and its client fails to read it as it
    /// would without the relay (spec/braid-wire.md §10.3).
    #[error("malformed update: {why}")]
    Unreadable { why: String, block: Bytes },
}

/// The framer; feed it bytes with [`Framer::push`], take pieces with [`Framer::next_piece`].
#[derive(Debug)]
pub struct Framer {
    buf: BytesMut,
    max_update: usize,
    max_header_block: usize,
    at: Progress,
}

/// How far the update at the front of the buffer has been read.
#[derive(Debug, Default)]
struct Progress {
    /// Where the header block being read starts (the update's, or a patch's).
    block: usize,
    /// Where the search for that block's end goes on.
    scan: usize,
    /// Where the line being searched starts.
    line: usize,
    /// The update's head, once its block is complete.
    head: Option<UpdateHead>,
    /// Patches not read yet, and where the next one (or the end) is.
    patches_left: usize,
    pos: usize,
    /// Where the update ends, once known.
    end: Option<usize>,
}

#[derive(Debug)]
struct UpdateHead {
    status: Option<u16>,
    version: Option<VersionList>,
    parents: Option<VersionList>,
}

impl Framer {
    /// A framer that gives up on an update over `max_update` bytes or a
    /// header block over `max_header_block` bytes.
    pub fn new(max_update: usize, max_header_block: usize) -> Framer {
        Framer {
            buf: BytesMut::new(),
            max_update,
            max_header_block,
            at: Progress::default(),
        }
    }

    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Drops `n` framed bytes from the front; a read buffer grown large
    /// for one update is not kept once it is empty (a session would hold
    /// one as large as its largest update for as long as it lives).
    fn consume(&mut self, n: usize) {
        self.buf.advance(n);
        if self.buf.is_empty() && self.buf.capacity() > IDLE_CAPACITY {
            self.buf = BytesMut::new();
        }
    }

    /// Bytes buffered and not framed yet.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Bytes its read buffer holds (what it costs, framed or not).
    pub fn held(&self) -> usize {
        self.buf.capacity()
    }

    /// The next piece, `Ok(None)` when more bytes are needed.
    pub fn next_piece(&mut self) -> Result<Option<Piece>, FrameError> {
        if self.at.scan == 0 {
            let blank = if self.buf.starts_with(b"\r\n") {
                2
            } else if self.buf.starts_with(b"\n") {
                1
            } else {
                0
            };
            if blank > 0 {
                self.consume(blank);
                let line: &'static [u8] = if blank == 2 { b"\r\n" } else { b"\n" };
                return Ok(Some(Piece::Blank(Bytes::from_static(line))));
            }
            if self.buf.is_empty() || self.buf.as_ref() == b"\r" {
                return Ok(None);
            }
        }
        loop {
            if let Some(end) = self.at.end {
                if end > self.max_update {
                    return Err(FrameError::TooLarge(self.max_update));
                }
                if self.buf.len() < end {
                    return Ok(None);
                }
                let head = self.at.head.take().unwrap_or(UpdateHead {
                    status: None,
                    version: None,
                    parents: None,
                });
                self.at = Progress::default();
                // Copied out, not split off: a window entry must hold its
                // own bytes, not the read buffer they came in (which may
                // be much larger, and would stay allocated as long as it).
                let raw = Bytes::copy_from_slice(&self.buf[..end]);
                self.consume(end);
                return Ok(Some(Piece::Update(Framed {
                    raw,
                    status: head.status,
                    version: head.version,
                    parents: head.parents,
                })));
            }
            if self.at.head.is_some() {
                // Between patches: skip the blank lines before the next one.
                let at = &mut self.at;
                while matches!(self.buf.get(at.pos), Some(b'\r' | b'\n')) {
                    at.pos += 1;
                }
                if at.pos >= self.buf.len() {
                    return Ok(None);
                }
                if at.block < at.pos {
                    (at.block, at.scan, at.line) = (at.pos, at.pos, at.pos);
                }
            }
            let Some(block_end) = self.block_end()? else {
                return Ok(None);
            };
            let update_head = self.at.head.is_none();
            let block = match read_block(&self.buf[self.at.block..block_end], update_head) {
                Err(FrameError::Malformed(why))
                    if update_head && shown_as_is(&self.buf[..block_end]) =>
                {
                    return Err(FrameError::Unreadable {
                        why,
                        block: Bytes::copy_from_slice(&self.buf[..block_end]),
                    });
                }
                read => read?,
            };
            let at = &mut self.at;
            match at.head {
                None => {
                    let head = UpdateHead {
                        status: block.status,
                        version: block.versions("version", "Version")?,
                        parents: block.versions("parents", "Parents")?,
                    };
                    at.head = Some(head);
                    if let Some(len) = block.length("content-length")? {
                        if let Some(range) = block.get("content-range") {
                            check_range(range)?;
                        }
                        at.end = Some(block_end.saturating_add(len));
                    } else if let Some(count) = declared_patches(&block)? {
                        at.patches_left = count;
                        at.pos = block_end;
                        if count == 0 {
                            at.end = Some(block_end);
                        }
                    } else {
                        return Err(FrameError::NoLength);
                    }
                }
                Some(_) => {
                    let len = block
                        .length("content-length")?
                        .ok_or(FrameError::PatchWithoutLength)?;
                    let range = block.get("content-range").ok_or_else(|| {
                        FrameError::Malformed("a patch has no Content-Range".into())
                    })?;
                    check_range(range)?;
                    at.pos = block_end.saturating_add(len);
                    at.patches_left -= 1;
                    if at.patches_left == 0 {
                        at.end = Some(at.pos);
                    } else if at.pos > self.max_update {
                        return Err(FrameError::TooLarge(self.max_update));
                    }
                }
            }
        }
    }

    /// The end of the header block being read (after its blank line), or
    /// `None` until it has come; resumes where the last call stopped.
    fn block_end(&mut self) -> Result<Option<usize>, FrameError> {
        let at = &mut self.at;
        let buf = &self.buf[..];
        while let Some(i) = buf[at.scan..].iter().position(|&b| b == b'\n') {
            let nl = at.scan + i;
            let line = &buf[at.line..nl];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            at.scan = nl + 1;
            if at.scan - at.block > self.max_header_block {
                return Err(FrameError::HeaderBlockTooLarge(self.max_header_block));
            }
            if line.is_empty() {
                return Ok(Some(at.scan));
            }
            at.line = at.scan;
        }
        at.scan = buf.len();
        if at.scan - at.block > self.max_header_block {
            return Err(FrameError::HeaderBlockTooLarge(self.max_header_block));
        }
        Ok(None)
    }
}

/// The headers of one block, lower-cased names.
struct Block {
    status: Option<u16>,
    headers: Vec<(String, Bytes)>,
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

    /// A version list header, `None` when absent; unreadable is malformed.
    fn versions(&self, name: &str, shown: &'static str) -> Result<Option<VersionList>, FrameError> {
        self.get(name)
            .map(|v| {
                VersionList::parse_named(v, shown)
                    .map_err(|e| FrameError::Malformed(format!("{shown}: {}", e.reason)))
            })
            .transpose()
    }

    /// A length header: decimal digits only.
    fn length(&self, name: &str) -> Result<Option<usize>, FrameError> {
        self.get(name).map(|v| decimal(v, name)).transpose()
    }
}

fn decimal(v: &[u8], name: &str) -> Result<usize, FrameError> {
    let ok = !v.is_empty() && v.len() <= 19 && v.iter().all(u8::is_ascii_digit);
    ok.then(|| std::str::from_utf8(v).ok()?.parse().ok())
        .flatten()
        .ok_or_else(|| {
            FrameError::Malformed(format!(
                "{name} {:?} is not a length",
                String::from_utf8_lossy(&v[..v.len().min(40)])
            ))
        })
}

/// Reads one complete header block (ending with its blank line).
fn read_block(bytes: &[u8], update: bool) -> Result<Block, FrameError> {
    let mut status = None;
    let mut headers = Vec::new();
    let mut first = true;
    for line in bytes.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            break;
        }
        if std::mem::take(&mut first) && update {
            if let Some(code) = status_line(line)? {
                status = Some(code);
                continue;
            }
        }
        // `name: value`; a pseudo-header keeps its leading colon.
        let from = usize::from(line.first() == Some(&b':'));
        let colon = line[from..]
            .iter()
            .position(|&b| b == b':')
            .map(|c| from + c)
            .filter(|&c| c > from && line[from..c].iter().all(|&b| is_token(b)))
            .ok_or_else(|| {
                FrameError::Malformed(format!(
                    "a header line that is not `name: value`: {:?}",
                    String::from_utf8_lossy(&line[..line.len().min(40)])
                ))
            })?;
        let name = String::from_utf8_lossy(&line[..colon]).to_ascii_lowercase();
        let value = trim(&line[colon + 1..]);
        if !value
            .iter()
            .all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
        {
            return Err(FrameError::Malformed(format!(
                "the {name} header has control bytes"
            )));
        }
        if name == ":status" {
            status = Some(status_code(value)?);
        }
        headers.push((name, Bytes::copy_from_slice(value)));
    }
    Ok(Block { status, headers })
}

/// Text a client can be shown as it came: no control bytes but CR, LF and tab.
fn shown_as_is(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .all(|&b| matches!(b, b'\t' | b'\r' | b'\n') || (b >= 0x20 && b != 0x7f))
}

fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The code of `HTTP/1.1 200 OK`, `HTTP 200 OK` or `200 OK`; `None` for a
/// line that is not a status line; malformed when it starts like one but
/// has no three-digit code.
fn status_line(line: &[u8]) -> Result<Option<u16>, FrameError> {
    let rest = match line.strip_prefix(b"HTTP") {
        Some(rest) => match rest.iter().position(|&b| b == b' ') {
            Some(sp) => &rest[sp + 1..],
            None => return Err(FrameError::Malformed("a status line without a code".into())),
        },
        None if line.first().is_some_and(u8::is_ascii_digit) => line,
        None => return Ok(None),
    };
    status_code(&rest[..rest.len().min(3)])
        .ok()
        .filter(|_| matches!(rest.get(3), None | Some(b' ')))
        .map(Some)
        .ok_or_else(|| FrameError::Malformed("a status line without a three-digit code".into()))
}

fn status_code(v: &[u8]) -> Result<u16, FrameError> {
    let code = (v.len() == 3 && v.iter().all(u8::is_ascii_digit))
        .then(|| std::str::from_utf8(v).ok()?.parse::<u16>().ok())
        .flatten()
        .filter(|c| (100..=599).contains(c));
    code.ok_or_else(|| FrameError::Malformed("a status that is not a three-digit code".into()))
}

/// A patch range: `<unit> <range>`; text and byte ranges must read
/// `[a:b]` with a <= b (other units' ranges are their own).
fn check_range(v: &[u8]) -> Result<(), FrameError> {
    let bad = || {
        FrameError::Malformed(format!(
            "Content-Range {:?}",
            String::from_utf8_lossy(&v[..v.len().min(40)])
        ))
    };
    let text = std::str::from_utf8(v).map_err(|_| bad())?;
    let (unit, range) = text.trim().split_once(' ').ok_or_else(bad)?;
    if unit.is_empty() || !unit.bytes().all(is_token) {
        return Err(bad());
    }
    if matches!(unit, "text" | "bytes") {
        super::span_of(range).ok_or_else(bad)?;
    }
    Ok(())
}

/// How many patches an update declares: `Patches: N`, or
/// `Content-Type: application/http-patches; count=N`.
fn declared_patches(b: &Block) -> Result<Option<usize>, FrameError> {
    if let Some(v) = b.get("patches") {
        return decimal(v, "Patches").map(Some);
    }
    let Some(ct) = b.get("content-type") else {
        return Ok(None);
    };
    let ct = String::from_utf8_lossy(ct).to_ascii_lowercase();
    let Some((_, params)) = ct.split_once("/http-patches") else {
        return Ok(None);
    };
    let count = params
        .split_once("count")
        .and_then(|(_, c)| c.trim_start().strip_prefix('='))
        .ok_or_else(|| FrameError::Malformed("http-patches without a count".into()))?;
    decimal(trim(count.as_bytes()), "count").map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(input: &[u8], step: usize) -> Vec<Piece> {
        let mut f = Framer::new(1 << 20, 64 * 1024);
        let mut out = Vec::new();
        for chunk in input.chunks(step) {
            f.push(chunk);
            while let Some(p) = f.next_piece().expect("frames") {
                out.push(p);
            }
        }
        assert_eq!(f.buffered(), 0);
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
        let mut f = Framer::new(1024, 1024);
        f.push(b"Version: \"a\"\r\n\r\nrest");
        assert_eq!(f.next_piece(), Err(FrameError::NoLength));
    }

    fn first_error(input: &[u8]) -> FrameError {
        let mut f = Framer::new(1 << 16, 1024);
        f.push(input);
        loop {
            match f.next_piece() {
                Ok(Some(_)) => continue,
                Ok(None) => panic!(
                    "{:?} framed without an error",
                    String::from_utf8_lossy(input)
                ),
                Err(e) => return e,
            }
        }
    }

    #[test]
    fn malformed_updates_are_errors_not_pieces() {
        for input in [
            &b"Version: not-json\r\nContent-Length: 1\r\n\r\nx"[..],
            b"Version: \"a\"\r\nParents: [\r\nContent-Length: 1\r\n\r\nx",
            b"Version: \"a\"\r\nContent-Length: -5\r\n\r\nx",
            b"Version: \"a\"\r\nContent-Length: 5x\r\n\r\nxxxxx",
            b"Version: \"a\"\r\nContent-Range: text [5:2]\r\nContent-Length: 1\r\n\r\nx",
            b"Version: \"a\"\r\nPatches: 1\r\n\r\nContent-Length: 1\r\nContent-Range: bytes [x:1]\r\n\r\nx",
            b"Version: \"a\"\r\nPatches: 1\r\n\r\nContent-Length: 1\r\n\r\nx",
            b"Version: \"a\"\r\nPatches: two\r\n\r\n",
            b"\x00\x01\xff garbage\r\n\r\n",
            b"Version: \"a\"\r\nX-Bad: a\x01b\r\nContent-Length: 0\r\n\r\n",
        ] {
            let e = first_error(input);
            assert!(
                matches!(e, FrameError::Malformed(_)),
                "{:?}: {e}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn an_unreadable_update_head_comes_back_whole_however_it_arrives() {
        let good = b"Version: \"a\"\r\nContent-Length: 2\r\n\r\nok\r\n\r\n";
        for head in [
            &b"hello: true\r\nhello\r\nContent-Length: 2\r\n\r\n"[..],
            b"HTP 555\r\n\r\n",
            b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
        ] {
            let input = [&good[..], head, b"hi"].concat();
            for step in [1, 7, input.len()] {
                let mut f = Framer::new(1 << 20, 4096);
                let mut error = None;
                for chunk in input.chunks(step) {
                    f.push(chunk);
                    loop {
                        match f.next_piece() {
                            Ok(Some(_)) => continue,
                            Ok(None) => break,
                            Err(e) => {
                                error = Some(e);
                                break;
                            }
                        }
                    }
                    if error.is_some() {
                        break;
                    }
                }
                match error {
                    Some(FrameError::Unreadable { block, .. }) => {
                        assert_eq!(&block[..], head, "step {step}")
                    }
                    other => panic!("step {step}: {other:?}"),
                }
            }
        }
        // A patch's unreadable block, or one with control bytes, is not handed on.
        for input in [
            &b"Version: \"a\"\r\nPatches: 1\r\n\r\nno colon\r\n\r\n"[..],
            b"bad\x01line\r\n\r\n",
        ] {
            assert!(matches!(first_error(input), FrameError::Malformed(_)));
        }
    }

    #[test]
    fn an_endless_header_block_is_bounded_and_read_once() {
        let mut f = Framer::new(1 << 20, 4096);
        f.push(b"Version: \"a\"\r\n");
        let mut error = None;
        for _ in 0..10_000 {
            f.push(b"X-Long: aaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
            match f.next_piece() {
                Ok(None) => {}
                Ok(Some(p)) => panic!("framed {p:?}"),
                Err(e) => {
                    error = Some(e);
                    break;
                }
            }
        }
        assert_eq!(error, Some(FrameError::HeaderBlockTooLarge(4096)));
        // Resumed, not restarted: one byte at a time frames as a whole does.
        let update = b"Version: \"b\"\r\nPatches: 2\r\n\r\nContent-Length: 1\r\nContent-Range: text [0:0]\r\n\r\nx\r\nContent-Length: 2\r\nContent-Range: text [1:1]\r\n\r\nyz\r\n";
        let mut f = Framer::new(1 << 20, 4096);
        let mut pieces = Vec::new();
        for b in update {
            f.push(&[*b]);
            while let Some(p) = f.next_piece().expect("frames") {
                pieces.push(p);
            }
        }
        assert!(matches!(&pieces[0], Piece::Update(u) if u.raw.ends_with(b"yz")));
        assert_eq!(pieces.len(), 2, "the update and its blank line: {pieces:?}");
    }
}
