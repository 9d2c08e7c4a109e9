//! A connection whose first bytes were already read: over TLS the fast
//! path cannot peek at a request head, so it reads it, and when it does
//! not take the request, hyper reads those bytes again from here first.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `inner`, with `first` read before anything of its own.
pub struct Replay<S> {
    first: Bytes,
    inner: S,
}

impl<S> Replay<S> {
    pub fn new(first: Bytes, inner: S) -> Replay<S> {
        Replay { first, inner }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Replay<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.first.is_empty() {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        let n = self.first.len().min(buf.remaining());
        buf.put_slice(&self.first[..n]);
        self.first.advance(n);
        if self.first.is_empty() {
            // Give the read-ahead's memory back for the connection's life.
            self.first = Bytes::new();
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Replay<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn the_first_bytes_come_before_the_stream_s_own_and_writes_go_through() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut replay = Replay::new(Bytes::from_static(b"GET / HT"), near);
        far.write_all(b"TP/1.1\r\n\r\n").await.unwrap();
        let mut got = vec![0u8; 18];
        replay.read_exact(&mut got).await.unwrap();
        assert_eq!(got, b"GET / HTTP/1.1\r\n\r\n");
        replay.write_all(b"HTTP/1.1 200 OK\r\n").await.unwrap();
        let mut back = vec![0u8; 17];
        far.read_exact(&mut back).await.unwrap();
        assert_eq!(back, b"HTTP/1.1 200 OK\r\n");
    }
}
