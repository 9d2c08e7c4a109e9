//! Write coalescing for h2c connections: the frames of the streams one
//! update wakes share `writev`s instead of taking one each.
//!
//! An update wakes each subscription stream's task. Each one hands its DATA
//! frame to the connection and wakes the connection's task, which tokio
//! runs next (the woken task takes the worker's LIFO slot). Left alone, the
//! connection then writes that one frame to the socket: at 100 streams per
//! connection that is about one `writev` per delivery, and the kernel's
//! cost of a send is most of what a delivery costs.
//!
//! [`Coalesce`] makes the first write of each batch wait one turn of the
//! scheduler: it wakes its own task and returns `Pending`, which puts the
//! connection's task at the back of the run queue. The stream tasks already
//! queued run first and add their frames; when the connection runs again
//! it writes them together. (Streams that overflowed into the runtime's
//! global queue still come after: 2.7 frames per write at 100 streams per
//! connection, BENCHMARKS.md, "Fan-out over h2c".) Only the first write of a batch waits (the
//! rest of it, up to the flush that ends it, goes straight to the socket),
//! and the wait is one pass over tasks that are ready: with nothing else
//! to run, the connection runs again at once. Nothing is held in this
//! type: the bytes stay in h2's own bounded send buffer.
//!
//! A connection with one open stream (a browser tab with one subscription
//! over HTTPS) has nothing to gather: one update is one frame. There the
//! wait only delays the write behind every other connection's streams, so
//! it is skipped. [`Streams`] (src/listen/idle.rs) counts a connection's
//! open streams: each request holds a guard until its response body is
//! dropped.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::listen::idle::Streams;

/// An I/O stream whose writes are gathered per scheduler turn, when its
/// connection has more than one open stream.
pub struct Coalesce<T> {
    inner: T,
    /// A batch is open: its first write has waited its turn, and what
    /// follows goes straight through until a flush ends it.
    open: bool,
    streams: Arc<Streams>,
}

impl<T> Coalesce<T> {
    pub fn new(inner: T, streams: Arc<Streams>) -> Coalesce<T> {
        Coalesce {
            inner,
            open: false,
            streams,
        }
    }

    /// Ready when a write may go to the socket; the first of a batch is
    /// sent to the back of the run queue first, unless the connection has
    /// one stream or none.
    fn turn(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.open || !self.streams.many() {
            return Poll::Ready(());
        }
        self.open = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Coalesce<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Coalesce<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        std::task::ready!(this.turn(cx));
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        std::task::ready!(this.turn(cx));
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let flushed = Pin::new(&mut this.inner).poll_flush(cx);
        if flushed.is_ready() {
            this.open = false;
        }
        flushed
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::listen::idle::StreamGuard;
    use std::sync::{Arc, Mutex};
    use tokio::io::AsyncWriteExt;
    use tokio::sync::Notify;

    /// A sink that records each write it is given.
    #[derive(Clone, Default)]
    struct Writes(Arc<Mutex<Vec<Vec<u8>>>>);

    impl AsyncWrite for Writes {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.0.lock().unwrap().push(buf.to_vec());
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// What h2 does with one update: `streams` tasks, woken together, each
    /// hand a frame to the connection and wake its task; the connection
    /// writes whatever frames it has each time it runs, then flushes.
    /// Returns the writes the socket saw.
    async fn one_update(streams: usize, coalesce: bool) -> Vec<Vec<u8>> {
        let sink = Writes::default();
        let frames: Arc<Mutex<Vec<u8>>> = Arc::default();
        let conn_wake = Arc::new(Notify::new());
        let update = Arc::new(Notify::new());
        let done = Arc::new(tokio::sync::Semaphore::new(0));
        // The connection's open streams, as hyper's would be counted.
        let many = Arc::new(Streams::default());
        let _open: Vec<StreamGuard> = (0..streams).map(|_| many.open()).collect();
        let conn = {
            let (sink, frames, conn_wake, done) = (
                sink.clone(),
                frames.clone(),
                conn_wake.clone(),
                done.clone(),
            );
            tokio::spawn(async move {
                let mut io: Pin<Box<dyn AsyncWrite + Send>> = if coalesce {
                    Box::pin(Coalesce::new(sink, many.clone()))
                } else {
                    Box::pin(sink)
                };
                let mut written = 0;
                while written < streams {
                    conn_wake.notified().await;
                    let batch = std::mem::take(&mut *frames.lock().unwrap());
                    if batch.is_empty() {
                        continue;
                    }
                    written += batch.len();
                    io.write_all(&batch).await.unwrap();
                    io.flush().await.unwrap();
                }
                done.add_permits(1);
            })
        };
        let mut tasks = Vec::new();
        for i in 0..streams {
            let (frames, conn_wake, update) = (frames.clone(), conn_wake.clone(), update.clone());
            // Registered now, so that the wake below reaches every one.
            let mut registered = Box::pin(update.clone().notified_owned());
            registered.as_mut().enable();
            tasks.push(tokio::spawn(async move {
                registered.await;
                frames.lock().unwrap().push(i as u8);
                conn_wake.notify_one();
            }));
        }
        // Wake them all from a task, as the proxy's publish does.
        tokio::spawn(async move { update.notify_waiters() })
            .await
            .unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(10), done.acquire())
            .await
            .expect("every frame written")
            .unwrap()
            .forget();
        conn.await.unwrap();
        for t in tasks {
            t.await.unwrap();
        }
        let writes = sink.0.lock().unwrap().clone();
        writes
    }

    fn runtime() -> tokio::runtime::Runtime {
        // One worker, as the proxy pinned to one core has: its LIFO slot
        // is what runs the connection right after each stream.
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn the_frames_of_one_update_leave_in_two_writes_at_most() {
        let rt = runtime();
        let writes = rt.block_on(one_update(50, true));
        let bytes: Vec<u8> = writes.concat();
        let mut sorted = bytes.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<u8>>(), "every frame, once");
        assert!(writes.len() <= 2, "{} writes for 50 frames", writes.len());
    }

    #[test]
    fn without_it_the_connection_writes_each_frame_alone() {
        // The control: the test above would pass without Coalesce only if
        // the scheduler batched the frames by itself.
        let rt = runtime();
        let writes = rt.block_on(one_update(50, false));
        assert_eq!(writes.concat().len(), 50);
        assert!(writes.len() > 10, "{} writes for 50 frames", writes.len());
    }

    /// A write on a connection with one open stream (or none) goes to the
    /// socket at once; with two it waits its turn first; a stream closed
    /// (its guard dropped) counts no more.
    #[test]
    fn a_connection_with_one_stream_writes_without_waiting() {
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let sink = Writes::default();
        let streams = Arc::new(Streams::default());
        let mut io = Coalesce::new(sink.clone(), streams.clone());
        let first = streams.open();
        assert!(Pin::new(&mut io).poll_write(&mut cx, b"a").is_ready());
        let second = streams.open();
        assert!(Pin::new(&mut io).poll_flush(&mut cx).is_ready());
        assert!(Pin::new(&mut io).poll_write(&mut cx, b"b").is_pending());
        assert!(Pin::new(&mut io).poll_write(&mut cx, b"b").is_ready());
        assert!(Pin::new(&mut io).poll_flush(&mut cx).is_ready());
        drop(second);
        assert!(Pin::new(&mut io).poll_write(&mut cx, b"c").is_ready());
        drop(first);
        assert_eq!(
            *sink.0.lock().unwrap(),
            [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]
        );
    }
}
