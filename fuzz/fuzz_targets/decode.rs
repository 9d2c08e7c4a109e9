//! Feeds arbitrary bytes, in chunks whose sizes come from the input, to the
//! 209-stream decoder. It must never panic, and every update it decodes must
//! survive encode → decode unchanged.
#![no_main]

use braid_proxy::braid::{encode, DecodeLimits, Decoder};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else { return };
    let chunk = usize::from(split % 32) + 1;
    let limits = DecodeLimits { max_header_block: 4096, max_content_length: 1 << 16, max_patches: 64 };
    let mut decoder = Decoder::new(limits);
    for piece in rest.chunks(chunk) {
        decoder.push(piece);
        loop {
            match decoder.next_update() {
                Ok(Some(update)) => {
                    let bytes = encode(&update);
                    let mut again = Decoder::new(limits);
                    again.push(&bytes);
                    let round = again.next_update().expect("re-decodes").expect("complete");
                    assert_eq!(round, update);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
});
