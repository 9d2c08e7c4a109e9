//! HTTP/1.1 chunk framing, for the paths that write chunks themselves
//! (the subscription fast path and direct delivery).

use bytes::{BufMut, Bytes, BytesMut};

/// A chunk-size line (`<hex>\r\n`) on the stack.
pub struct ChunkSize {
    bytes: [u8; 18],
    start: usize,
}

impl ChunkSize {
    pub fn new(mut n: usize) -> ChunkSize {
        let mut bytes = [0u8; 18];
        bytes[16] = b'\r';
        bytes[17] = b'\n';
        let mut start = 16;
        loop {
            start -= 1;
            bytes[start] = b"0123456789abcdef"[n & 15];
            n >>= 4;
            if n == 0 {
                break;
            }
        }
        ChunkSize { bytes, start }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[self.start..]
    }
}

/// `data` as one HTTP/1.1 chunk.
pub fn chunk(data: &[u8]) -> Bytes {
    let size = ChunkSize::new(data.len());
    let mut out = BytesMut::with_capacity(size.as_bytes().len() + data.len() + 2);
    out.put_slice(size.as_bytes());
    out.put_slice(data);
    out.put_slice(b"\r\n");
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_size_lines() {
        assert_eq!(ChunkSize::new(0).as_bytes(), b"0\r\n");
        assert_eq!(ChunkSize::new(255).as_bytes(), b"ff\r\n");
        assert_eq!(ChunkSize::new(0x1234_5678).as_bytes(), b"12345678\r\n");
        assert_eq!(
            ChunkSize::new(usize::MAX).as_bytes(),
            b"ffffffffffffffff\r\n"
        );
    }
}
