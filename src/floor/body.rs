//! The one response/request body type of the proxy, and the data chunk it
//! carries. A [`Chunk`] can hold a pending-bytes guard, so the metrics know
//! how many bytes subscribers' connections hold but have not yet written.

use std::sync::Arc;

use bytes::{Buf, Bytes};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};

use crate::metrics::Metrics;

/// Any error a body can yield.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every response the proxy writes and every request it sends.
pub type Body = UnsyncBoxBody<Chunk, BoxError>;

/// The body of a client request as the router sees it: hyper's `Incoming`
/// boxed, or an empty body for a request the proxy parsed itself
/// ([`crate::listen::fastpath`]).
/// (`Sync` too, as `Incoming` is: requests are borrowed across awaits.)
/// Its error is hyper's (an empty body never fails), a concrete type.
pub type RequestBody = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

/// hyper's body (a client's request, or an upstream's response) as a [`RequestBody`].
pub fn incoming(body: hyper::body::Incoming) -> RequestBody {
    body.boxed()
}

/// An empty [`RequestBody`].
pub fn no_request_body() -> RequestBody {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}

/// A chunk of body data: shared [`Bytes`], plus an optional guard that counts
/// it as pending in the metrics until the connection has written (dropped) it.
pub struct Chunk {
    bytes: Bytes,
    _pending: Option<Pending>,
}

impl Chunk {
    /// A chunk that is not counted.
    pub fn plain(bytes: Bytes) -> Chunk {
        Chunk {
            bytes,
            _pending: None,
        }
    }

    /// A chunk counted in `braid_proxy_subscriber_pending_bytes` until dropped.
    pub fn counted(bytes: Bytes, metrics: &Arc<Metrics>) -> Chunk {
        let pending = Pending::new(bytes.len(), metrics);
        Chunk {
            bytes,
            _pending: Some(pending),
        }
    }
}

impl From<Bytes> for Chunk {
    fn from(bytes: Bytes) -> Chunk {
        Chunk::plain(bytes)
    }
}

impl Buf for Chunk {
    fn remaining(&self) -> usize {
        self.bytes.remaining()
    }
    fn chunk(&self) -> &[u8] {
        self.bytes.chunk()
    }
    fn advance(&mut self, cnt: usize) {
        self.bytes.advance(cnt)
    }
}

struct Pending {
    len: usize,
    metrics: Arc<Metrics>,
}

impl Pending {
    fn new(len: usize, metrics: &Arc<Metrics>) -> Pending {
        metrics.pending_add(len);
        Pending {
            len,
            metrics: metrics.clone(),
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.metrics.pending_sub(self.len);
    }
}

/// An empty body.
pub fn empty() -> Body {
    Empty::<Chunk>::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A body of the given bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(Chunk::plain(bytes.into()))
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Wraps any body of `Bytes` (such as hyper's `Incoming`) without buffering it.
pub fn stream<B>(body: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_frame(|f| f.map_data(Chunk::plain))
        .map_err(Into::into)
        .boxed_unsync()
}

/// Records that a client's request body failed (cut short, bad chunk
/// framing, a reset) while it was being forwarded, so that the failed
/// upstream exchange is blamed on the client (400), never on the upstream.
#[derive(Debug, Clone, Default)]
pub struct ClientFault(Arc<std::sync::OnceLock<String>>);

impl ClientFault {
    /// What went wrong with the client's body, if anything did.
    pub fn reason(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }
}

/// As [`stream`], for a client's request body: an error it yields is
/// recorded in the returned [`ClientFault`] as well as passed on.
pub fn client_stream<B>(body: B) -> (Body, ClientFault)
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let fault = ClientFault::default();
    let record = fault.clone();
    let body = body
        .map_frame(|f| f.map_data(Chunk::plain))
        .map_err(move |e| {
            let e: BoxError = e.into();
            let _ = record.0.set(e.to_string());
            e
        })
        .boxed_unsync();
    (body, fault)
}

/// A byte budget shared by the copies [`tee`] keeps of answers in flight,
/// so that many large answers streaming at once cannot outgrow memory.
#[derive(Debug)]
pub struct CopyBudget {
    used: std::sync::atomic::AtomicUsize,
    limit: usize,
}

/// Bytes reserved from a [`CopyBudget`], given back when dropped.
#[derive(Debug)]
pub struct CopyReservation {
    budget: Arc<CopyBudget>,
    bytes: usize,
}

impl CopyBudget {
    pub fn new(limit: usize) -> CopyBudget {
        CopyBudget {
            used: 0.into(),
            limit,
        }
    }

    /// Reserves `bytes`, or `None` when the budget has no room for them.
    pub fn reserve(self: &Arc<Self>, bytes: usize) -> Option<CopyReservation> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut used = self.used.load(Relaxed);
        loop {
            let next = used.checked_add(bytes).filter(|n| *n <= self.limit)?;
            match self
                .used
                .compare_exchange_weak(used, next, Relaxed, Relaxed)
            {
                Ok(_) => {
                    return Some(CopyReservation {
                        budget: self.clone(),
                        bytes,
                    })
                }
                Err(now) => used = now,
            }
        }
    }

    /// Bytes reserved now.
    pub fn used(&self) -> usize {
        self.used.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for CopyReservation {
    fn drop(&mut self) {
        self.budget
            .used
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A body gathered into `buf`, held at its length: a buffer that grew by
/// doubling may hold up to twice its length, and what is kept is counted
/// (and capped) by its length.
pub fn compact(buf: bytes::BytesMut) -> Bytes {
    if buf.capacity() - buf.len() > buf.len() / 16 + 4096 {
        Bytes::copy_from_slice(&buf)
    } else {
        buf.freeze()
    }
}

/// What a [`tee`] does with the whole body once it has passed through.
pub type OnComplete = Box<dyn FnOnce(Bytes) + Send>;

/// Streams `body` through unchanged while keeping a copy of up to `limit`
/// bytes; when the body ends complete and within the limit, `done` gets the
/// copy. A body cut short, failed, or over the limit is not kept. Whatever
/// `guard` holds (such as a lock that concurrent requests wait on) is
/// released when the body ends or is dropped.
pub fn tee<G>(body: Body, limit: usize, guard: G, done: OnComplete) -> Body
where
    G: Send + Unpin + 'static,
{
    Tee {
        inner: body,
        copy: Some(bytes::BytesMut::new()),
        limit,
        done: Some(done),
        _guard: Some(guard),
    }
    .boxed_unsync()
}

struct Tee<G> {
    inner: Body,
    copy: Option<bytes::BytesMut>,
    limit: usize,
    done: Option<OnComplete>,
    _guard: Option<G>,
}

impl<G> Tee<G> {
    fn finish(&mut self) {
        if let (Some(copy), Some(done)) = (self.copy.take(), self.done.take()) {
            done(compact(copy));
        }
        self.done = None;
        self._guard = None;
    }
}

impl<G: Unpin> http_body::Body for Tee<G> {
    type Data = Chunk;
    type Error = BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Chunk>, BoxError>>> {
        use std::task::Poll;
        let this = self.get_mut();
        match std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(copy)) = (frame.data_ref(), this.copy.as_mut()) {
                    if copy.len() + data.remaining() > this.limit {
                        this.copy = None;
                    } else {
                        copy.extend_from_slice(data.chunk());
                    }
                }
                if this.inner.is_end_stream() {
                    this.finish();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.copy = None;
                this._guard = None;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                this.finish();
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // The end is reported once `done` has run.
        self.done.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_copy_budget_is_shared_and_given_back() {
        let budget = Arc::new(CopyBudget::new(100));
        let a = budget.reserve(60).expect("room");
        assert!(budget.reserve(50).is_none(), "over the limit");
        let b = budget.reserve(40).expect("room");
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 40);
        drop(b);
        assert_eq!(budget.used(), 0);
        assert!(budget.reserve(101).is_none());
    }
}
