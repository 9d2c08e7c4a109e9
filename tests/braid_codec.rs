//! The wire codec: golden bytes from the drafts' examples, encode → decode
//! round trips under random chunking, and the decoder's limits.

use braid_proxy::braid::{
    encode, Body, DecodeError, DecodeLimits, Decoder, Patch, Update, VersionId, VersionList,
};
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use proptest::prelude::*;

fn versions(ids: &[&str]) -> VersionList {
    VersionList::new(
        ids.iter()
            .map(|s| VersionId::new(*s).expect("valid id"))
            .collect(),
    )
}

fn decode_all(bytes: &[u8], chunk: usize) -> Result<Vec<Update>, DecodeError> {
    let mut decoder = Decoder::new(DecodeLimits::default());
    let mut out = Vec::new();
    for piece in bytes.chunks(chunk.max(1)) {
        decoder.push(piece);
        while let Some(update) = decoder.next_update()? {
            out.push(update);
        }
    }
    assert_eq!(decoder.buffered(), 0, "bytes left over");
    Ok(out)
}

/// draft-toomim-httpbis-braid-http-04 §4 (subscription example), with the
/// framing braid-http 1.3.80 reads: one snapshot, then a one-patch update.
#[test]
fn golden_subscription_from_the_draft() {
    let stream = b"Version: \"ej4lhb9z78\"\r\nParents: \"oakwn5b8qh\", \"uc9zwhw7mf\"\r\nContent-Type: application/json\r\nMerge-Type: sync9\r\nContent-Length: 65\r\n\r\n[{\"text\": \"Hi, everyone!\",\r\n  \"author\": {\"link\": \"/user/tommy\"}}]\r\n\r\nVersion: \"g09ur8z74r\"\r\nParents: \"ej4lhb9z78\"\r\nContent-Length: 3\r\nContent-Range: json [0].text\r\n\r\n\"x\"\r\n\r\n";
    let updates = decode_all(stream, 7).expect("decodes");
    assert_eq!(updates.len(), 2);
    assert_eq!(updates[0].version, versions(&["ej4lhb9z78"]));
    assert_eq!(updates[0].parents, versions(&["oakwn5b8qh", "uc9zwhw7mf"]));
    assert!(matches!(&updates[0].body, Body::Snapshot(b) if b.len() == 65));
    assert_eq!(updates[0].extra_headers.len(), 2);
    let Body::Patches(p) = &updates[1].body else {
        panic!("expected a patch")
    };
    assert_eq!(p[0].range, "[0].text");
    assert_eq!(&p[0].content[..], b"\"x\"");
}

/// The encoder's bytes for the INTEROP example update.
#[test]
fn golden_one_patch_update() {
    let update = Update {
        status: Some(200),
        version: versions(&["v2"]),
        parents: versions(&["v1"]),
        body: Body::Patches(vec![Patch::text(3, 3, "hello")]),
        extra_headers: vec![],
    };
    assert_eq!(
        &encode(&update)[..],
        &b"HTTP/1.1 200 OK\r\nVersion: \"v2\"\r\nParents: \"v1\"\r\nContent-Length: 5\r\nContent-Range: text [3:3]\r\n\r\nhello\r\n\r\n"[..]
    );
}

#[test]
fn bare_lf_blank_lines_and_patches_blocks() {
    let stream = b"\n\nHTTP/1.1 200 OK\nVersion: \"b\"\nParents: \"a\"\nPatches: 2\n\nContent-Length: 1\nContent-Range: text [0:0]\n\nx\n\nContent-Length: 0\nContent-Range: text [4:5]\n\n\n\n\r\n";
    let updates = decode_all(stream, 1).expect("decodes");
    assert_eq!(updates.len(), 1);
    assert_eq!(updates[0].status, Some(200));
    let Body::Patches(p) = &updates[0].body else {
        panic!("expected patches")
    };
    assert_eq!(p.len(), 2);
    assert_eq!(p[1].range, "[4:5]");
}

#[test]
fn status_line_as_braid_http_servers_write_it() {
    // braid-http 1.3.80's server writes `HTTP 200 OK`, without a protocol version.
    let stream = b"HTTP 200 OK\r\nVersion: \"v1\"\r\nContent-Length: 11\r\n\r\nhello world\r\n\r\nHTTP 404 Not Found\r\nVersion: \"v2\"\r\nParents: \"v1\"\r\nContent-Length: 0\r\n\r\n";
    let updates = decode_all(stream, 3).expect("decodes");
    assert_eq!(updates.len(), 2);
    assert_eq!(updates[0].status, Some(200));
    assert_eq!(
        updates[0].body,
        Body::Snapshot(Bytes::from_static(b"hello world"))
    );
    assert_eq!(updates[1].status, Some(404));
    assert_eq!(updates[1].parents, versions(&["v1"]));
}

#[test]
fn limits_give_typed_errors() {
    let limits = DecodeLimits {
        max_header_block: 64,
        max_content_length: 10,
        max_patches: 2,
    };
    let run = |bytes: &[u8]| {
        let mut d = Decoder::new(limits);
        d.push(bytes);
        d.next_update()
    };
    assert_eq!(
        run(&[b'x'; 100]),
        Err(DecodeError::HeaderBlockTooLarge { limit: 64 })
    );
    assert_eq!(
        run(b"Content-Length: 11\r\n\r\n"),
        Err(DecodeError::ContentLengthTooLarge {
            length: 11,
            limit: 10
        })
    );
    assert_eq!(
        run(b"Patches: 3\r\n\r\n"),
        Err(DecodeError::TooManyPatches { count: 3, limit: 2 })
    );
    assert_eq!(
        run(b"Version: \"a\"\r\n\r\n"),
        Err(DecodeError::MissingContentLength)
    );
    assert!(matches!(
        run(b"Version: a\r\nContent-Length: 0\r\n\r\n"),
        Err(DecodeError::BadHeader { .. })
    ));
    assert_eq!(
        run(b"HTTP/1.1 abc\r\n\r\n"),
        Err(DecodeError::BadStatusLine)
    );
}

fn version_id() -> impl Strategy<Value = VersionId> {
    "[a-zA-Z0-9 \"\\\\é😀-]{1,12}".prop_map(|s| VersionId::new(s).expect("no control chars"))
}

fn patch() -> impl Strategy<Value = Patch> {
    (
        0usize..1000,
        0usize..50,
        proptest::collection::vec(any::<u8>(), 0..40),
        any::<bool>(),
    )
        .prop_map(|(start, len, content, text)| {
            if text {
                Patch::text(
                    start,
                    start + len,
                    String::from_utf8_lossy(&content).into_owned(),
                )
            } else {
                Patch::bytes(start, start + len, content)
            }
        })
}

fn update() -> impl Strategy<Value = Update> {
    (
        proptest::option::of(prop_oneof![
            Just(200u16),
            Just(404),
            Just(410),
            Just(502),
            Just(299)
        ]),
        proptest::collection::vec(version_id(), 0..3),
        proptest::collection::vec(version_id(), 0..3),
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..200)
                .prop_map(|b| Body::Snapshot(Bytes::from(b))),
            proptest::collection::vec(patch(), 0..5).prop_map(Body::Patches),
        ],
        proptest::collection::vec(("x-[a-z]{1,8}", "[!-~]([ -~]{0,10}[!-~])?"), 0..3),
    )
        .prop_map(|(status, version, parents, body, extra)| Update {
            status,
            version: VersionList::new(version),
            parents: VersionList::new(parents),
            body,
            extra_headers: extra
                .into_iter()
                .map(|(n, v)| {
                    (
                        HeaderName::try_from(n).expect("name"),
                        HeaderValue::try_from(v).expect("value"),
                    )
                })
                .collect(),
        })
}

proptest! {
    #[test]
    fn encode_then_decode_is_the_identity(
        updates in proptest::collection::vec(update(), 1..5),
        chunk in 1usize..64,
        heartbeats in 0usize..3,
        bare_lf_between in any::<bool>(),
    ) {
        let mut stream = Vec::new();
        for u in &updates {
            stream.extend_from_slice(&encode(u));
            for _ in 0..heartbeats {
                stream.extend_from_slice(if bare_lf_between { b"\n" } else { b"\r\n" });
            }
        }
        let decoded = decode_all(&stream, chunk).expect("decodes");
        prop_assert_eq!(decoded, updates);
    }

    #[test]
    fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400), chunk in 1usize..50) {
        let mut decoder = Decoder::new(DecodeLimits { max_header_block: 128, max_content_length: 256, max_patches: 4 });
        for piece in bytes.chunks(chunk) {
            decoder.push(piece);
            while let Ok(Some(_)) = decoder.next_update() {}
        }
    }
}

/// The body braid-http 1.3.80 sends for a PUT with several patches
/// (`braid-http-client.js`, "Multiple patches get sent within a Patches: N
/// block"): each patch's `content-length` and `content-range`, a blank
/// line, the content and CRLF, with CRLF between patches.
fn braid_http_put_body(patches: &[Patch]) -> Vec<u8> {
    let mut body = Vec::new();
    for (i, p) in patches.iter().enumerate() {
        if i > 0 {
            body.extend_from_slice(b"\r\n");
        }
        let head = format!(
            "content-length: {}\r\ncontent-range: {} {}\r\n\r\n",
            p.content.len(),
            p.unit.as_str(),
            p.range
        );
        body.extend_from_slice(head.as_bytes());
        body.extend_from_slice(&p.content);
        body.extend_from_slice(b"\r\n");
    }
    body
}

proptest! {
    #[test]
    fn braid_http_put_bodies_decode_to_their_patches(
        raw in proptest::collection::vec(
            (any::<bool>(), 0usize..50, 0usize..5, proptest::collection::vec(any::<u8>(), 0..20)),
            0..6,
        ),
    ) {
        let patches: Vec<Patch> = raw
            .into_iter()
            .map(|(text, a, len, content)| {
                if text {
                    Patch::text(a, a + len, String::from_utf8_lossy(&content).into_owned())
                } else {
                    Patch::bytes(a, a + len, content)
                }
            })
            .collect();
        let body = braid_http_put_body(&patches);
        let decoded = braid_proxy::braid::decode_patches(&body, patches.len(), &DecodeLimits::default())
            .expect("decodes");
        prop_assert_eq!(decoded, patches.clone());
        // A count that does not match the body is an error, never a guess.
        let fewer = braid_proxy::braid::decode_patches(&body, patches.len() + 1, &DecodeLimits::default());
        prop_assert!(matches!(fewer, Err(DecodeError::TooFewPatches { .. })), "{:?}", fewer);
        if !patches.is_empty() {
            let more = braid_proxy::braid::decode_patches(&body, patches.len() - 1, &DecodeLimits::default());
            prop_assert!(more.is_err(), "{:?}", more);
        }
    }
}
