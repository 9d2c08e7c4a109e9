//! Feeds arbitrary bytes, as an upstream's 209 body in chunks whose sizes
//! come from the input, to the relay's framer. It must never panic, must
//! stay within its bounds, and what it frames must be exactly the bytes it
//! was given: framed updates and blank lines, in order, up to the first
//! error (or the bytes still buffered).
#![no_main]

use braid_proxy::braid::{Framer, Piece};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else { return };
    let chunk = usize::from(split % 32) + 1;
    let mut framer = Framer::new(1 << 16, 4096);
    let mut out = Vec::new();
    let mut pushed = 0;
    'feed: for piece in rest.chunks(chunk) {
        framer.push(piece);
        pushed += piece.len();
        loop {
            match framer.next_piece() {
                Ok(Some(Piece::Blank(b))) => out.extend_from_slice(&b),
                Ok(Some(Piece::Update(u))) => {
                    assert!(u.raw.len() <= 1 << 16);
                    out.extend_from_slice(&u.raw);
                }
                Ok(None) => break,
                Err(_) => break 'feed,
            }
        }
        assert_eq!(out.len() + framer.buffered(), pushed);
    }
    assert_eq!(&rest[..out.len()], &out[..]);
});
