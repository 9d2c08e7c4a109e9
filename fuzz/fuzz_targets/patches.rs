//! A patch write's request body (`Patches: N` blocks) and `Content-Range`
//! value on arbitrary input: no panics; decoded patches re-encode and
//! decode to the same patches, and applying them to a document either
//! works or is a typed error.
#![no_main]

use braid_proxy::braid::{self, decode_patches, parse_content_range, Body, DecodeLimits, Update};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&count, body)) = data.split_first() else {
        return;
    };
    let _ = parse_content_range(body);
    let limits = DecodeLimits {
        max_patches: 16,
        ..DecodeLimits::default()
    };
    let Ok(patches) = decode_patches(body, usize::from(count % 8), &limits) else {
        return;
    };
    let _ = braid::apply_patches("héllo wörld 👋".as_bytes(), &patches);
    if patches.len() < 2 {
        return; // one patch is encoded as Content-Range, not as a Patches block
    }
    let encoded = braid::encode(&Update {
        status: None,
        version: Default::default(),
        parents: Default::default(),
        body: Body::Patches(patches.clone()),
        extra_headers: Vec::new(),
    });
    // The encoder writes `Patches: N`, a blank line, then the blocks.
    let start = encoded
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a header block")
        + 4;
    let again =
        decode_patches(&encoded[start..], patches.len(), &limits).expect("own output decodes");
    assert_eq!(again, patches);
});
