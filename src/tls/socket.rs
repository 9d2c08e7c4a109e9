//! An HTTP/1.1 connection over TLS after its handshake, usable through a
//! shared reference: the TCP stream and the connection's rustls session
//! under a lock that is never held across an `.await`.
//!
//! This is what lets the HTTP/1.1 subscription fast path and direct
//! delivery (src/listen/fastpath.rs, src/deliver/direct.rs) serve TLS
//! clients as they serve plain ones. Both write to a subscriber's
//! connection from wherever the write is due (its own task, or the sweep
//! of its window) while its task waits for the client to close; over TLS
//! every byte goes through the session, so each of those steps takes the
//! lock, moves bytes between the session and the socket without blocking,
//! and lets go. The plaintext of an update is still built once and shared
//! by every subscriber; each session encrypts it with its own keys, which
//! is the least TLS can cost.
//!
//! The session holds at most [`SEND_BUFFER`](super::server::SEND_BUFFER)
//! bytes of encrypted output: a write first flushes what an earlier one
//! left, and takes new plaintext only once that is in the kernel, so a
//! stalled reader's updates wait in the shared window (where they
//! collapse), not in its session.
//!
//! It also implements `AsyncRead` and `AsyncWrite`, so that hyper serves
//! the connection's other requests, and a subscription the fast path does
//! not take, over the same session.

use std::io::{self, IoSlice, Read, Write};
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{ready, Context, Poll};

use rustls::ServerConnection;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

use crate::floor::sync::lock;

/// A TLS connection (HTTP/1.1 by ALPN) after its handshake.
pub struct TlsSocket {
    tcp: TcpStream,
    session: Mutex<ServerConnection>,
}

/// What one non-blocking write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sent {
    /// Plaintext bytes the session took (encrypted, and in the kernel
    /// unless `pending`).
    pub taken: usize,
    /// Encrypted bytes wait in the session for the socket: a flush must
    /// follow before the connection can be left alone.
    pub pending: bool,
}

/// The TCP stream as rustls's reader, without blocking: a would-block
/// clears the stream's readiness, so the next wait for it is a real one.
struct TryRead<'a>(&'a TcpStream);

impl Read for TryRead<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.try_read(buf)
    }
}

/// The TCP stream as rustls's writer, without blocking (as [`TryRead`]).
struct TryWrite<'a>(&'a TcpStream);

impl Write for TryWrite<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.try_write(buf)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.0.try_write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes the session's encrypted bytes until none wait (true) or the
/// socket takes no more (false).
fn flush(session: &mut ServerConnection, tcp: &TcpStream) -> io::Result<bool> {
    while session.wants_write() {
        match session.write_tls(&mut TryWrite(tcp)) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

impl TlsSocket {
    /// The connection of a finished handshake. Nothing is lost: plaintext
    /// the handshake read ahead stays in the session.
    pub fn new(stream: TlsStream<TcpStream>) -> TlsSocket {
        let (tcp, session) = stream.into_inner();
        TlsSocket {
            tcp,
            session: Mutex::new(session),
        }
    }

    /// The TCP stream under the session.
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Writes what the socket takes now, without blocking: first the
    /// encrypted bytes an earlier write left (a would-block if they do not
    /// all go), then as much of `bufs` as the session's bound allows.
    pub fn try_send(&self, bufs: &[IoSlice<'_>]) -> io::Result<Sent> {
        let mut session = lock(&self.session);
        if !flush(&mut session, &self.tcp)? {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let taken = session.writer().write_vectored(bufs)?;
        let pending = !flush(&mut session, &self.tcp)?;
        Ok(Sent { taken, pending })
    }

    /// Writes the encrypted bytes that wait, without blocking; true when
    /// none are left.
    pub fn try_flush(&self) -> io::Result<bool> {
        flush(&mut lock(&self.session), &self.tcp)
    }

    /// Reads plaintext the client sent, without blocking: `Ok(0)` when it
    /// closed (with `close_notify` or without), a would-block when nothing
    /// has come. Whatever else its records asked for (an alert, a key
    /// update's answer) is written if the socket takes it now, or with the
    /// next write.
    pub fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut session = lock(&self.session);
        loop {
            match session.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(e) => return Err(e),
            }
            let read = session.read_tls(&mut TryRead(&self.tcp))?;
            let processed = session.process_new_packets();
            // An alert for a bad record, or a key update's answer.
            let _ = flush(&mut session, &self.tcp);
            if let Err(e) = processed {
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
            if read == 0 {
                // End of stream: the session's reader now says how (a
                // clean close or a truncation), both of which are a close.
                match session.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                    Err(e) => return Err(e),
                }
            }
        }
    }

    /// Sends `close_notify` and as much as the socket takes now, then
    /// half-closes the TCP stream.
    fn try_close(&self) -> io::Result<()> {
        let mut session = lock(&self.session);
        session.send_close_notify();
        let _ = flush(&mut session, &self.tcp)?;
        socket2::SockRef::from(&self.tcp).shutdown(std::net::Shutdown::Write)
    }
}

impl AsyncRead for TlsSocket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            match self.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    ready!(self.tcp.poll_read_ready(cx))?;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for TlsSocket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            match self.try_send(bufs) {
                // Encrypted bytes left in the session go with the next
                // write or the flush hyper makes after each response part.
                Ok(sent) if sent.taken > 0 || bufs.iter().all(|b| b.is_empty()) => {
                    return Poll::Ready(Ok(sent.taken))
                }
                // Nothing waited, yet nothing was taken: the session
                // has closed for writing.
                Ok(_) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
            ready!(self.tcp.poll_write_ready(cx))?;
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            if self.try_flush()? {
                return Poll::Ready(Ok(()));
            }
            ready!(self.tcp.poll_write_ready(cx))?;
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.as_mut().poll_flush(cx))?;
        Poll::Ready(self.try_close())
    }
}
