//! A subscriber's connection as the paths that write to it themselves see
//! it (the HTTP/1.1 fast path and direct delivery): a TCP stream, or a TLS
//! session over one ([`TlsSocket`]). Every operation works through a
//! shared reference, so that the wait for the client to close and the
//! writes of its task or of a sweep go on at once.

use std::io::{self, IoSlice};

use bytes::Buf;
use tokio::net::TcpStream;

pub use crate::tls::socket::Sent;
use crate::tls::socket::TlsSocket;

/// A client connection written to without hyper.
pub enum Socket {
    Plain(TcpStream),
    /// Boxed: a session is over a kilobyte, and inline it would size
    /// every plain subscriber's socket too.
    Tls(Box<TlsSocket>),
}

/// How a wait on the client's side of a live response ended.
pub enum Spoke {
    /// It closed its side, or the connection broke.
    Closed,
    /// It sent bytes (read and dropped).
    Spoke,
}

impl Socket {
    /// The TCP stream (under the TLS session, if any).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Socket::Plain(tcp) => tcp,
            Socket::Tls(tls) => tls.tcp(),
        }
    }

    /// One non-blocking send of `buf`, for a sweep. On a plain socket it
    /// goes straight to the kernel: a would-block leaves tokio's readiness
    /// as it was, and the subscriber's task, handed back, finds out for
    /// itself.
    pub fn send_now(&self, buf: &[u8]) -> io::Result<Sent> {
        match self {
            Socket::Plain(tcp) => socket2::SockRef::from(tcp).send(buf).map(|taken| Sent {
                taken,
                pending: false,
            }),
            Socket::Tls(tls) => tls.try_send(&[IoSlice::new(buf)]),
        }
    }

    /// Writes all of `buf`, vectored, and over TLS everything the session
    /// holds (so an empty `buf` flushes what a sweep left).
    pub async fn write_all(&self, buf: &mut impl Buf) -> io::Result<()> {
        match self {
            Socket::Plain(tcp) => write_all_plain(tcp, buf).await,
            Socket::Tls(tls) => write_all_tls(tls, buf).await,
        }
    }

    /// Resolves when the client closes its side (or the connection
    /// breaks), or sends bytes, which are read and dropped.
    pub async fn closed_or_spoke(&self) -> Spoke {
        let mut scratch = [0u8; 64];
        loop {
            if self.tcp().readable().await.is_err() {
                return Spoke::Closed;
            }
            let read = match self {
                Socket::Plain(tcp) => tcp.try_read(&mut scratch),
                Socket::Tls(tls) => tls.try_read(&mut scratch),
            };
            match read {
                Ok(0) => return Spoke::Closed,
                Ok(_) => return Spoke::Spoke,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(_) => return Spoke::Closed,
            }
        }
    }
}

/// `sendmsg` rather than `writev`: a socket needs none of the file layer
/// `writev` goes through (its position lock and checks), which showed in
/// the profile of a 10,000-subscriber fan-out.
async fn write_all_plain(tcp: &TcpStream, buf: &mut impl Buf) -> io::Result<()> {
    let socket = socket2::SockRef::from(tcp);
    while buf.has_remaining() {
        let mut slices = [IoSlice::new(&[]); 4];
        let count = buf.chunks_vectored(&mut slices);
        let sent = tcp.try_io(tokio::io::Interest::WRITABLE, || {
            socket.send_vectored(&slices[..count])
        });
        match sent {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf.advance(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => tcp.writable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn write_all_tls(tls: &TlsSocket, buf: &mut impl Buf) -> io::Result<()> {
    while buf.has_remaining() {
        let mut slices = [IoSlice::new(&[]); 4];
        let count = buf.chunks_vectored(&mut slices);
        match tls.try_send(&slices[..count]) {
            Ok(sent) if sent.taken == 0 => return Err(io::ErrorKind::WriteZero.into()),
            Ok(sent) => buf.advance(sent.taken),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => tls.tcp().writable().await?,
            Err(e) => return Err(e),
        }
    }
    while !tls.try_flush()? {
        tls.tcp().writable().await?;
    }
    Ok(())
}
