//! The update encoder: one [`Update`] → one contiguous `Bytes`, built once
//! and shared by every subscriber. The framing is in spec/braid-wire.md.

use std::fmt::Write;

use bytes::{BufMut, Bytes, BytesMut};

use super::{Body, Patch, Update};

/// Encodes an update: optional status line, then `Version` (first, as
/// braid-http 1.3.80 needs), `Parents`, extra headers, and the body as a
/// snapshot, one patch, or a `Patches: N` block; a blank line ends it.
pub fn encode(update: &Update) -> Bytes {
    let mut head = String::with_capacity(128);
    if let Some(status) = update.status {
        let reason = http::StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("");
        let _ = write!(head, "HTTP/1.1 {status} {reason}");
        head.truncate(head.trim_end().len());
        head.push_str("\r\n");
    }
    if !update.version.is_empty() {
        let _ = write!(head, "Version: {}\r\n", update.version.to_header_value());
    }
    if !update.parents.is_empty() {
        let _ = write!(head, "Parents: {}\r\n", update.parents.to_header_value());
    }
    // Sized for all of it, so a large body is never copied into a buffer
    // twice its size (growing a full buffer doubles it).
    let extra: usize = update
        .extra_headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    let mut out = BytesMut::with_capacity(head.len() + extra + body_len(&update.body) + 64);
    out.put_slice(head.as_bytes());
    for (name, value) in &update.extra_headers {
        out.put_slice(name.as_str().as_bytes());
        out.put_slice(b": ");
        out.put_slice(value.as_bytes());
        out.put_slice(b"\r\n");
    }
    match &update.body {
        Body::Snapshot(body) => {
            let _ = write!(Header(&mut out), "Content-Length: {}\r\n\r\n", body.len());
            out.put_slice(body);
        }
        Body::Patches(patches) if patches.len() == 1 => put_patch(&mut out, &patches[0]),
        Body::Patches(patches) => {
            let _ = write!(Header(&mut out), "Patches: {}\r\n\r\n", patches.len());
            for (i, patch) in patches.iter().enumerate() {
                if i > 0 {
                    out.put_slice(b"\r\n\r\n");
                }
                put_patch(&mut out, patch);
            }
        }
    }
    out.put_slice(b"\r\n\r\n");
    out.freeze()
}

/// A heartbeat: one blank line.
pub fn encode_heartbeat() -> Bytes {
    Bytes::from_static(b"\r\n")
}

fn put_patch(out: &mut BytesMut, patch: &Patch) {
    let _ = write!(
        Header(out),
        "Content-Length: {}\r\nContent-Range: {} {}\r\n\r\n",
        patch.content.len(),
        patch.unit.as_str(),
        patch.range
    );
    out.put_slice(&patch.content);
}

fn body_len(body: &Body) -> usize {
    match body {
        Body::Snapshot(b) => b.len(),
        Body::Patches(p) => patches_wire_len(p),
    }
}

/// About how many bytes these patches take on the wire.
pub fn patches_wire_len(patches: &[Patch]) -> usize {
    patches
        .iter()
        .map(|p| p.content.len() + p.range.len() + 48)
        .sum()
}

struct Header<'a>(&'a mut BytesMut);

impl Write for Header<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.put_slice(s.as_bytes());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Body, Patch, Update, VersionId, VersionList};
    use super::*;

    fn v(s: &str) -> VersionList {
        VersionList::single(VersionId::new(s).unwrap())
    }

    #[test]
    fn one_patch() {
        let u = Update {
            status: None,
            version: v("v2"),
            parents: v("v1"),
            body: Body::Patches(vec![Patch::text(3, 3, "hello")]),
            extra_headers: vec![],
        };
        assert_eq!(
            &encode(&u)[..],
            b"Version: \"v2\"\r\nParents: \"v1\"\r\nContent-Length: 5\r\nContent-Range: text [3:3]\r\n\r\nhello\r\n\r\n"
        );
    }

    #[test]
    fn status_snapshot() {
        let u = Update {
            status: Some(404),
            version: v("gone"),
            parents: VersionList::default(),
            body: Body::Snapshot(Bytes::new()),
            extra_headers: vec![],
        };
        assert_eq!(
            &encode(&u)[..],
            b"HTTP/1.1 404 Not Found\r\nVersion: \"gone\"\r\nContent-Length: 0\r\n\r\n\r\n\r\n"
        );
    }

    #[test]
    fn several_patches() {
        let u = Update {
            status: None,
            version: v("v3"),
            parents: v("v2"),
            body: Body::Patches(vec![Patch::text(0, 1, "a"), Patch::text(5, 5, "bc")]),
            extra_headers: vec![],
        };
        assert_eq!(
            &encode(&u)[..],
            &b"Version: \"v3\"\r\nParents: \"v2\"\r\nPatches: 2\r\n\r\nContent-Length: 1\r\nContent-Range: text [0:1]\r\n\r\na\r\n\r\nContent-Length: 2\r\nContent-Range: text [5:5]\r\n\r\nbc\r\n\r\n"[..]
        );
    }
}
