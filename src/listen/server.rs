//! Listeners and connections: the accept loops, HTTP/1.1 and h2c with prior
//! knowledge (told apart by peeking at the connection preface), the timer
//! that makes the header-read timeout work, per-connection limits, and
//! graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulConnection, GracefulShutdown, Watcher};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};

use crate::admin;
use crate::config::Config;
use crate::deliver::socket::Socket;
use crate::floor::body::BoxError;
use crate::limits::{AcceptErrors, ClientConnection};
use crate::listen::coalesce::Coalesce;
use crate::listen::fastpath;
use crate::listen::idle::{counted, Connections, Listing, StreamGuard, Streams};
use crate::listen::replay::Replay;
use crate::router::Router;
use crate::tls::socket::TlsSocket;
use crate::tls::ServerTls;
use crate::upstream::ConnInfo;

/// How often the descriptors other than client connections are counted.
const FILES_COUNTED_EVERY: Duration = Duration::from_secs(1);

/// Write-buffer bound per connection: hyper stops pulling a response body
/// once this much is queued, which is what makes slow readers cheap.
const CONNECTION_WRITE_BUFFER: usize = 16 * 1024;

/// A bound but not yet running proxy. Binding first lets callers (and tests)
/// learn the addresses, including port 0 ones, before serving.
pub struct Server {
    config: Config,
    listener: TcpListener,
    admin: Option<TcpListener>,
    /// TLS hook (issue 47): `--tls-cert` makes the listener TLS only.
    tls: Option<Arc<ServerTls>>,
}

impl Server {
    /// Binds the client listener and, if configured, the admin listener.
    /// A TLS file that does not load is an `InvalidInput` error naming it.
    pub async fn bind(mut config: Config) -> std::io::Result<Server> {
        let tls = ServerTls::from_config(&config)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        // An https upstream's TLS files, checked before anything listens
        // (the upstream client loads them again when the server runs).
        if let Some(upstream) = &config.upstream {
            crate::tls::client::UpstreamTls::from_config(upstream, &config)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        }
        // Each listener's failure names its address (an admin port in use
        // is not the client port's fault).
        let cannot = |addr: std::net::SocketAddr, what: &'static str| {
            move |e: std::io::Error| {
                std::io::Error::new(e.kind(), format!("cannot listen on {addr} ({what}): {e}"))
            }
        };
        let listener = TcpListener::bind(config.listen)
            .await
            .map_err(cannot(config.listen, "--listen"))?;
        if config.proxy_id.is_empty() {
            config.proxy_id = crate::config::default_proxy_id(listener.local_addr()?.port());
        }
        let admin = match config.admin_listen {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .map_err(cannot(addr, "--admin-listen"))?,
            ),
            None => None,
        };
        Ok(Server {
            config,
            listener,
            admin,
            tls,
        })
    }

    /// The listener's TLS, when it has some (its reload is what `SIGHUP` calls).
    pub fn tls(&self) -> Option<Arc<ServerTls>> {
        self.tls.clone()
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The admin listener's address, if there is one.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Serves until `shutdown` resolves, then shuts down gracefully: stops
    /// accepting, ends subscription streams cleanly, and gives in-flight
    /// requests up to `shutdown_grace` to finish.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), BoxError> {
        let Server {
            config,
            listener,
            admin,
            tls,
        } = self;
        let reloading = tls.clone().map(|tls| tokio::spawn(tls.reload_on_sighup()));
        let grace = config.shutdown_grace;
        let router = Router::new(config)?;
        let graceful = GracefulShutdown::new();
        let builder = Arc::new(Builders::new(router.config()));
        let fast = Arc::new(FastPath::default());

        // Purges made above this tier reach it (src/purges.rs).
        let following = tokio::spawn(router.follow_purges());
        let admin_task = admin.map(|admin_listener| {
            let router = router.clone();
            tokio::spawn(admin::serve(admin_listener, router))
        });

        // Upstream connections and the like reach the descriptor estimate
        // by a count once a second; client connections are counted here.
        let files = router.open_files().clone();
        let counting = tokio::spawn(
            files
                .clone()
                .count_every(FILES_COUNTED_EVERY, router.closing()),
        );
        let connections = Arc::new(Connections::default());
        // Idle connections give way between accepts too: new ones that
        // never sent a request become reclaimable only after a grace.
        let reclaiming = tokio::spawn(reclaim_every(
            RECLAIM_EVERY,
            files.clone(),
            connections.clone(),
            router.closing(),
        ));
        let mut errors = AcceptErrors::new("client");
        let mut refusals = Refusals::default();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        errors.accepted();
                        let counted = files.connection();
                        // Within the reserve: the idlest idle connections
                        // give their descriptors back (src/listen/idle.rs).
                        let wanted = files.into_reserve();
                        if wanted > 0 {
                            connections.reclaim(wanted as usize);
                        }
                        let held = Held {
                            _counted: counted,
                            listing: connections.list(),
                        };
                        let watcher = graceful.watcher();
                        // The last quarter of the reserve is left to the
                        // admin listener and upstream connections: a new
                        // connection there waits a moment for the idle
                        // ones being closed, or is closed itself.
                        if !files.admits_connection() {
                            // Refused only when no idle connection is
                            // closing, nor can be closed now.
                            if connections.closing() == 0
                                && connections.reclaim_now(crate::listen::idle::MAX_RECLAIMED) == 0
                            {
                                refusals.refused(files.estimate(), files.limit());
                                continue;
                            }
                            let (files, builder, router) = (files.clone(), builder.clone(), router.clone());
                            let (fast, tls) = (fast.clone(), tls.clone());
                            tokio::spawn(async move {
                                if room_in_time(&files).await {
                                    serve_connection(stream, peer, held, &builder, &router, watcher, &fast, tls.as_ref());
                                }
                            });
                            continue;
                        }
                        serve_connection(stream, peer, held, &builder, &router, watcher, &fast, tls.as_ref());
                    }
                    // Out of file descriptors and the like: wait instead
                    // of spinning, and have the idlest connections make
                    // room; the subscriptions refused within the reserve
                    // and the connections closed in it make it rare.
                    Err(e) => {
                        if crate::limits::is_out_of_files(&e) {
                            connections.reclaim(crate::listen::idle::MAX_RECLAIMED);
                        }
                        tokio::time::sleep(errors.failed(&e)).await
                    }
                },
            }
        }
        counting.abort();
        reclaiming.abort();
        if let Some(task) = reloading {
            task.abort();
        }
        drop(listener);
        info!("shutting down: ending subscription streams, draining in-flight requests");
        router.begin_shutdown();
        following.abort();
        if let Some(task) = admin_task {
            task.abort();
        }
        let drained = async {
            graceful.shutdown().await;
            fast.drained().await;
        };
        if tokio::time::timeout(grace, drained).await.is_err() {
            warn!(
                ?grace,
                "grace period over; closing the remaining connections"
            );
        }
        Ok(())
    }
}

/// How long a new connection past the last quarter of the reserve waits
/// for the idle connections being closed to give their descriptors back
/// (their tasks must run to close them, and a graceful HTTP/2 close is
/// cut at [`RECLAIM_CLOSE`]).
const ROOM_WAIT: Duration = Duration::from_secs(1);

/// Whether the descriptors open fall below the last quarter of the
/// reserve within [`ROOM_WAIT`] (looked at every 5 ms). The connection
/// waiting is counted among them, so however many wait, no more are
/// served than fit.
async fn room_in_time(files: &crate::limits::OpenFiles) -> bool {
    let deadline = tokio::time::Instant::now() + ROOM_WAIT;
    while !files.admits_connection() {
        if tokio::time::Instant::now() >= deadline {
            debug!("too few open files left: a new client connection was closed");
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    true
}

/// How often the descriptor reserve is looked at between accepts.
const RECLAIM_EVERY: Duration = Duration::from_millis(250);

/// Every `every` until `closing` turns true: within the descriptor
/// reserve, the idlest idle connections are closed (src/listen/idle.rs),
/// as they are at each accept there. Outside it, a look costs two loads.
async fn reclaim_every(
    every: Duration,
    files: Arc<crate::limits::OpenFiles>,
    connections: Arc<Connections>,
    mut closing: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = closing.wait_for(|closing| *closing) => return,
        }
        let wanted = files.into_reserve();
        if wanted > 0 {
            connections.reclaim(wanted as usize);
        }
    }
}

/// The two protocol builders. hyper-util's auto builder is not used: it
/// reads the first bytes itself and hands them to hyper's HTTP/1.1 side as a
/// prefix, which makes that side grow its read buffer from 8 to 16 KiB on
/// the next read, a buffer every idle subscription then holds for good.
/// Peeking tells the protocols apart without consuming anything.
struct Builders {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
    header_read_timeout: Duration,
    /// `--h2-idle-timeout`.
    h2_idle_timeout: Duration,
}

impl Builders {
    fn new(config: &Config) -> Builders {
        let mut http1 = http1::Builder::new();
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(config.header_read_timeout)
            .max_buf_size(CONNECTION_WRITE_BUFFER.max(config.max_header_bytes + 1024));
        // hyper's own limit is 100 headers; naming a limit, even that one,
        // makes it fill two arrays of that many slots for every request head.
        if config.max_headers != HYPER_MAX_HEADERS {
            http1.max_headers(config.max_headers);
        }
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        http2
            .timer(TokioTimer::new())
            .max_header_list_size(config.max_header_bytes as u32)
            .max_send_buf_size(CONNECTION_WRITE_BUFFER)
            .max_concurrent_streams(config.max_streams_per_connection)
            .keep_alive_interval(Some(Duration::from_secs(30)));
        Builders {
            http1,
            http2,
            header_read_timeout: config.header_read_timeout,
            h2_idle_timeout: config.h2_idle_timeout,
        }
    }
}

/// The request headers hyper's HTTP/1.1 side accepts when told no limit.
const HYPER_MAX_HEADERS: usize = 100;

/// The HTTP/2 connection preface a prior-knowledge (h2c) client opens with.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Whether the connection speaks h2c (`Some(true)`), HTTP/1.1 (`Some(false)`),
/// or closed before saying (`None`), decided as hyper-util's auto builder
/// decides: HTTP/2 only on the whole preface. Nothing is consumed.
async fn is_h2(stream: &TcpStream) -> std::io::Result<Option<bool>> {
    let mut buf = [0u8; H2_PREFACE.len()];
    let mut wait = Duration::from_millis(5);
    loop {
        let n = stream.peek(&mut buf).await?;
        if n == 0 {
            return Ok(None);
        }
        if buf[..n] != H2_PREFACE[..n] {
            return Ok(Some(false));
        }
        if n == H2_PREFACE.len() {
            return Ok(Some(true));
        }
        // A strict prefix of the preface (rare: clients send it in one
        // write). Peeking again at once would return the same bytes, so wait
        // a moment for the rest, longer each time.
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_millis(100));
    }
}

/// Caps the bytes the kernel holds unsent for this connection
/// (`TCP_NOTSENT_LOWAT`): the socket reports writable only below it, so a
/// stalled subscriber's updates wait in the proxy's shared window, where
/// they collapse into one, and not in the kernel's send buffer. 0 = the
/// system default.
fn limit_unsent(stream: &TcpStream, lowat: usize) {
    if lowat == 0 {
        return;
    }
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let lowat = u32::try_from(lowat).unwrap_or(u32::MAX);
        if let Err(e) = socket2::SockRef::from(stream).set_tcp_notsent_lowat(lowat) {
            tracing::debug!(error = %e, "TCP_NOTSENT_LOWAT not set");
        }
    }
}

/// Reads and drops the `n` bytes of a request head already peeked at.
async fn consume(stream: &mut TcpStream, n: usize) -> std::io::Result<()> {
    let mut head = vec![0u8; n];
    stream.read_exact(&mut head).await.map(drop)
}

/// Counts the connections answering on the fast path, so that shutdown
/// waits for them as hyper's graceful watcher waits for its own.
#[derive(Default)]
struct FastPath {
    active: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

struct Active(Arc<FastPath>);

impl FastPath {
    fn enter(self: &Arc<Self>) -> Active {
        self.active.fetch_add(1, Ordering::Relaxed);
        Active(self.clone())
    }

    async fn drained(&self) {
        loop {
            let idle = self.idle.notified();
            if self.active.load(Ordering::Relaxed) == 0 {
                return;
            }
            idle.await;
        }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// What keeps a client connection in the books while its task lives: its
/// descriptor counted in the budget, and its listing among the
/// connections whose idlest are closed when descriptors run low.
struct Held {
    _counted: ClientConnection,
    listing: Listing,
}

/// New client connections closed at accept, past the descriptors kept for
/// the admin listener and upstream connections: logged at most once a
/// second.
#[derive(Default)]
struct Refusals {
    logged: Option<std::time::Instant>,
    unlogged: u64,
}

impl Refusals {
    fn refused(&mut self, open: u64, limit: u64) {
        let now = std::time::Instant::now();
        if self
            .logged
            .is_some_and(|at| now - at < Duration::from_secs(1))
        {
            self.unlogged += 1;
            return;
        }
        warn!(
            open,
            limit,
            more = self.unlogged,
            "too few open files left: a new client connection was closed at once (more: since the last line)"
        );
        self.logged = Some(now);
        self.unlogged = 0;
    }
}

/// Serves one client connection in a task of its own; `held` keeps it in
/// the descriptor budget and the list of connections until the task ends,
/// with the socket.
#[allow(clippy::too_many_arguments)]
fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    held: Held,
    builder: &Arc<Builders>,
    router: &Router,
    watcher: Watcher,
    fast: &Arc<FastPath>,
    tls: Option<&Arc<ServerTls>>,
) {
    let _ = stream.set_nodelay(true);
    limit_unsent(&stream, router.config().notsent_lowat);
    let local = match stream.local_addr() {
        Ok(local) => local,
        Err(_) => return,
    };
    let trusted = router.config().trusted_downstream.contains(peer.ip());
    let conn_info = ConnInfo {
        peer,
        local,
        trusted,
    };
    let mut closing = router.closing();
    let router = router.clone();
    let builder = builder.clone();
    let fast = fast.clone();
    let streams = held.listing.streams().clone();
    // TLS hook (issue 47, src/tls/server.rs): the handshake, within the
    // header-read timeout, then h2 by ALPN or HTTP/1.1 with the fast path,
    // in a task of its own: a TLS session is kilobytes, which would
    // otherwise size every plain connection's task, and the plain path's
    // states would size every TLS one's.
    if let Some(tls) = tls {
        let tls = tls.clone();
        tokio::spawn(async move {
            let _held = held;
            serve_tls(
                tls, stream, router, conn_info, builder, watcher, closing, fast, streams,
            )
            .await
        });
        return;
    }
    tokio::spawn(async move {
        let _held = held;
        // The header-read timeout also covers the wait for the first bytes.
        // A connection that has not started a request when shutdown begins,
        // or when it is closed for its descriptor, is closed at once (its
        // watcher would otherwise hold shutdown up).
        let first = tokio::select! {
            first = tokio::time::timeout(builder.header_read_timeout, is_h2(&stream)) => first,
            _ = closing.wait_for(|closing| *closing) => return,
            _ = streams.reclaimed() => return debug!(%peer, "idle connection closed: too few open files left"),
        };
        let h2 = match first {
            Ok(Ok(Some(h2))) => h2,
            Ok(Ok(None)) => return,
            Ok(Err(e)) => return debug!(%peer, error = %e, "connection failed before a request"),
            Err(_) => return debug!(%peer, "no request within the header-read timeout"),
        };
        let mut stream = stream;
        if !h2 {
            // A subscription that arrived whole is answered without hyper.
            let config = router.config();
            let (max_head, max_headers) = (config.max_header_bytes, config.max_headers);
            if let Some(parsed) = fastpath::peek(&stream, max_head, max_headers).await {
                if consume(&mut stream, parsed.head_len).await.is_err() {
                    return;
                }
                let socket = Socket::Plain(stream);
                let busy = streams.open();
                let answered = answer_fast(socket, parsed, &router, conn_info, &fast, &closing);
                let back = answered.await;
                drop(busy);
                match back {
                    Some(Socket::Plain(back)) => stream = back,
                    _ => return,
                }
            }
        }
        serve_hyper(
            stream, h2, router, conn_info, &builder, watcher, closing, streams,
        )
        .await
    });
}

/// Answers a subscription the fast path took (src/listen/fastpath.rs) on
/// `socket`; the socket back when the response ended cleanly and the
/// connection can serve its next request.
async fn answer_fast(
    socket: Socket,
    parsed: fastpath::Parsed,
    router: &Router,
    conn_info: ConnInfo,
    fast: &Arc<FastPath>,
    closing: &tokio::sync::watch::Receiver<bool>,
) -> Option<Socket> {
    let _active = fast.enter();
    let answer = Box::pin(router.handle(parsed.request, conn_info));
    let (response, spoke) = fastpath::answer_unless_gone(&socket, answer).await?;
    // Shared while the response lasts: direct delivery writes to a parked
    // subscription's socket (src/deliver/direct.rs).
    let shared = Arc::new(socket);
    let after = fastpath::write_response(&shared, response).await;
    if spoke || after == fastpath::After::Close || *closing.borrow() {
        return None;
    }
    // A sweep that just handed the subscription back may still hold the
    // socket for a moment: then close.
    Arc::try_unwrap(shared).ok()
}

/// TLS hook (issue 47): the handshake of a connection to a TLS listener,
/// within the header-read timeout (a failed one is a debug line: scanners
/// make many; plain HTTP gets a readable 400), then hyper over h2 when
/// ALPN chose it. Over HTTP/1.1 the client's first bytes are read (nothing
/// can be peeked at under TLS): a subscription that arrived whole in them
/// takes the fast path, as on a plain connection, and anything else goes
/// to hyper with those bytes replayed.
///
/// The opening (handshake and first bytes) runs in a future of its own,
/// boxed and freed once done, and so does each way of serving after it:
/// inline, their states made this future about 10 KiB, held for the
/// connection's life, an open subscription's included.
#[allow(clippy::too_many_arguments)]
async fn serve_tls(
    tls: Arc<ServerTls>,
    stream: TcpStream,
    router: Router,
    conn_info: ConnInfo,
    builder: Arc<Builders>,
    watcher: Watcher,
    mut closing: tokio::sync::watch::Receiver<bool>,
    fast: Arc<FastPath>,
    streams: Arc<Streams>,
) {
    let opening = open_tls(
        tls,
        stream,
        &router,
        conn_info.peer,
        &builder,
        &mut closing,
        &streams,
    );
    let (stream, first) = match Box::pin(opening).await {
        None => return,
        Some(Opened::H2(stream)) => {
            let serving = serve_hyper(
                stream, true, router, conn_info, &builder, watcher, closing, streams,
            );
            return Box::pin(serving).await;
        }
        Some(Opened::Http1(stream, first)) => (stream, first),
    };
    let max_headers = router.config().max_headers;
    let taken = fastpath::parse(&first)
        .filter(|p| p.head_len == first.len() && p.request.headers().len() <= max_headers);
    let (stream, first) = match taken {
        Some(parsed) => {
            // The read-ahead is not kept for the subscription's life.
            drop(first);
            let socket = Socket::Tls(Box::new(stream));
            let busy = streams.open();
            let answered = answer_fast(socket, parsed, &router, conn_info, &fast, &closing);
            let back = Box::pin(answered).await;
            drop(busy);
            match back {
                Some(Socket::Tls(back)) => (*back, Bytes::new()),
                _ => return,
            }
        }
        None => (stream, Bytes::from(first)),
    };
    let stream = Replay::new(first, stream);
    let serving = serve_hyper(
        stream, false, router, conn_info, &builder, watcher, closing, streams,
    );
    Box::pin(serving).await
}

/// A TLS connection after its handshake: h2 by ALPN, or HTTP/1.1 with the
/// first bytes it sent.
enum Opened {
    H2(tokio_rustls::server::TlsStream<TcpStream>),
    Http1(TlsSocket, Vec<u8>),
}

/// The handshake of a TLS connection and, over HTTP/1.1, its first bytes,
/// within the header-read timeout; `None` when the connection is done
/// with (closed, failed, timed out, plain HTTP answered, shutdown, or
/// closed for its descriptor).
async fn open_tls(
    tls: Arc<ServerTls>,
    stream: TcpStream,
    router: &Router,
    peer: SocketAddr,
    builder: &Builders,
    closing: &mut tokio::sync::watch::Receiver<bool>,
    streams: &Streams,
) -> Option<Opened> {
    let timeout = builder.header_read_timeout;
    let deadline = tokio::time::Instant::now() + timeout;
    // A TLS record starts with its content type (20 to 24); a plain HTTP/1.1
    // request with its method's first letter. That one gets a readable 400
    // rather than a TLS alert, which clients show as garbage ("HTTP/0.9").
    let mut first = [0u8; 1];
    let peeked = tokio::select! {
        peeked = tokio::time::timeout_at(deadline, stream.peek(&mut first)) => peeked,
        _ = closing.wait_for(|closing| *closing) => return None,
        _ = streams.reclaimed() => return None,
    };
    let max_head = router.config().max_header_bytes;
    match peeked {
        Ok(Ok(0)) => return None,
        Ok(Ok(_)) if first[0].is_ascii_uppercase() => {
            refuse_plain_http(stream, peer, max_head).await;
            return None;
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "connection failed before a handshake");
            return None;
        }
        Err(_) => {
            debug!(%peer, "no TLS handshake within the header-read timeout");
            return None;
        }
    }
    let accepted = tokio::select! {
        accepted = tokio::time::timeout_at(deadline, tls.accept(stream)) => accepted,
        _ = closing.wait_for(|closing| *closing) => return None,
        _ = streams.reclaimed() => return None,
    };
    let stream = match accepted {
        Ok(Ok((stream, true))) => return Some(Opened::H2(stream)),
        Ok(Ok((stream, false))) => TlsSocket::new(stream),
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "TLS handshake failed");
            return None;
        }
        Err(_) => {
            debug!(%peer, "no TLS handshake within the header-read timeout");
            return None;
        }
    };
    let first = tokio::select! {
        first = tokio::time::timeout(timeout, fastpath::first_bytes_tls(&stream, max_head)) => first,
        _ = closing.wait_for(|closing| *closing) => return None,
        _ = streams.reclaimed() => return None,
    };
    match first {
        Ok(Ok(first)) if !first.is_empty() => Some(Opened::Http1(stream, first)),
        Ok(Ok(_)) => None,
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "connection failed before a request");
            None
        }
        Err(_) => {
            debug!(%peer, "no request within the header-read timeout");
            None
        }
    }
}

/// The answer to plain HTTP on a TLS listener, as one line of text.
const PLAIN_HTTP_ON_TLS: &str = "this port speaks HTTPS: the request was sent as plain HTTP\n";

/// Answers a plain HTTP request sent to a TLS listener with 400 and a
/// one-line reason, then closes. What the client sent (up to a request
/// head's bound) is read first and the rest drained for a moment after the
/// answer, so that closing with unread bytes does not reset the connection
/// before the client has read the answer. Bounded in bytes and time.
async fn refuse_plain_http(mut stream: TcpStream, peer: SocketAddr, max_head: usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    debug!(%peer, "plain HTTP on the TLS listener: 400");
    let linger = Duration::from_secs(1);
    // On the heap: in the future it would size every TLS connection's task.
    let mut buf = vec![0u8; 4096];
    let _ = tokio::time::timeout(linger, stream.read(&mut buf)).await;
    let answer = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{PLAIN_HTTP_ON_TLS}",
        PLAIN_HTTP_ON_TLS.len()
    );
    if tokio::time::timeout(linger, stream.write_all(answer.as_bytes()))
        .await
        .is_err()
    {
        return;
    }
    let _ = stream.shutdown().await;
    let drain = async {
        let mut left = max_head.max(buf.len());
        while left > 0 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(linger, drain).await;
}

/// Serves a connection (TCP, or TLS after its handshake) with hyper:
/// HTTP/2 when `h2`, HTTP/1.1 otherwise. `streams` counts its open
/// requests (src/listen/idle.rs).
#[allow(clippy::too_many_arguments)]
async fn serve_hyper<S>(
    stream: S,
    h2: bool,
    router: Router,
    conn_info: ConnInfo,
    builder: &Builders,
    watcher: Watcher,
    closing: tokio::sync::watch::Receiver<bool>,
    streams: Arc<Streams>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let peer = conn_info.peer;
    let service = service(router, conn_info, streams.clone());
    let result = if h2 {
        // The frames of all the streams one update wakes go out in one
        // write, when there is more than one (src/listen/coalesce.rs).
        let io = TokioIo::new(Coalesce::new(stream, streams.clone()));
        let conn = builder.http2.serve_connection(io, service);
        let ends = Ends {
            first_request: Some(builder.header_read_timeout),
            idle: Some(builder.h2_idle_timeout),
        };
        // Boxed: the h2 state is twice the size of the HTTP/1.1 state,
        // and inline it would size every connection's task.
        Box::pin(drive(conn, peer, &streams, ends, closing, watcher)).await
    } else {
        let io = TokioIo::new(stream);
        let conn = builder.http1.serve_connection(io, service);
        let ends = Ends {
            first_request: None,
            idle: None,
        };
        // Boxed, so that a connection answered on the fast path does
        // not carry hyper's connection state in its task.
        Box::pin(drive(conn, peer, &streams, ends, closing, watcher)).await
    };
    if let Err(e) = result {
        debug!(%peer, error = %e, "connection ended with an error");
    }
}

/// When a connection served by hyper ends without its client ending it.
struct Ends {
    /// HTTP/2: a connection that sent its preface and no request within
    /// this (the header-read timeout), or by the start of shutdown, is
    /// dropped. HTTP/2 has no header-read timeout of its own.
    first_request: Option<Duration>,
    /// HTTP/2: a connection with no stream open for this long
    /// (`--h2-idle-timeout`) is shut down gracefully. HTTP/1.1 waits for
    /// its next request no longer than hyper's header-read timeout.
    idle: Option<Duration>,
}

/// Drives a connection served by hyper to its end. It is shut down
/// gracefully (hyper finishes what is in flight: GOAWAY over HTTP/2, no
/// next request over HTTP/1.1) when shutdown begins, when it is chosen
/// to give its descriptor back (src/listen/idle.rs), or when it has been
/// idle as long as `ends` allows. `watcher` holds the server's graceful
/// shutdown until the connection has ended (the router's `closing`, which
/// turns true first, is what starts this one's).
async fn drive<C>(
    conn: C,
    peer: SocketAddr,
    streams: &Streams,
    ends: Ends,
    mut closing: tokio::sync::watch::Receiver<bool>,
    watcher: Watcher,
) -> Result<(), hyper::Error>
where
    C: GracefulConnection<Error = hyper::Error>,
{
    let _watched = watcher;
    tokio::pin!(conn);
    let first_request = async {
        match ends.first_request {
            Some(timeout) => {
                tokio::time::sleep(timeout).await;
                if streams.served() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending().await,
        }
    };
    let idle = async {
        match ends.idle {
            Some(timeout) => streams.idle_timeout(timeout).await,
            None => std::future::pending().await,
        }
    };
    // Why it closes, and how long its graceful close may take (an HTTP/2
    // one waits for the client's answer to a PING): unbounded on shutdown
    // (the drain has its own bound), short when its descriptor is wanted.
    let (why, bound) = tokio::select! {
        result = conn.as_mut() => return result,
        _ = first_request => {
            debug!(%peer, "h2c connection sent no request in time");
            return Ok(());
        }
        _ = closing.wait_for(|closing| *closing) => {
            if ends.first_request.is_some() && !streams.served() {
                return Ok(());
            }
            ("shutdown", None)
        }
        _ = streams.reclaimed() => (
            "too few open files left: the idlest connections close",
            Some(RECLAIM_CLOSE),
        ),
        _ = idle => ("no stream open for --h2-idle-timeout", Some(IDLE_CLOSE)),
    };
    debug!(%peer, why, "closing the connection gracefully");
    conn.as_mut().graceful_shutdown();
    match bound {
        None => conn.await,
        // Past the bound the connection is dropped, and its socket closed.
        Some(bound) => tokio::time::timeout(bound, conn).await.unwrap_or(Ok(())),
    }
}

/// How long an idle connection closed to free its descriptor may take to
/// close gracefully (GOAWAY, then a PING the client must answer) before
/// its socket is closed anyway: a client slow to answer must not keep the
/// descriptor a new connection waits for ([`ROOM_WAIT`]).
const RECLAIM_CLOSE: Duration = Duration::from_millis(100);

/// The same for a connection closed by `--h2-idle-timeout`.
const IDLE_CLOSE: Duration = Duration::from_secs(1);

/// What the service of a connection returns for one request.
type Answer = std::pin::Pin<
    Box<dyn Future<Output = Result<http::Response<crate::floor::body::Body>, Infallible>> + Send>,
>;

/// The service of one connection. The request future is boxed: hyper keeps
/// a slot of the service future's size for the whole connection, and
/// `Router::handle` is a few KiB, which an idle subscription would otherwise
/// hold for nothing. And it is boxed twice: the outer box holds only the
/// request until the stream's task first polls it, and `Router::handle`'s
/// few KiB are allocated then. An HTTP/2 connection task makes the futures
/// of every stream a client opens in one burst (hundreds) before any of them
/// runs; boxed once, each would hold its few KiB from the start, and the
/// freed peak would stay in the process's RSS. `streams` counts the
/// connection's open requests, each until its response body is dropped
/// (src/listen/idle.rs), and whether any came.
fn service(
    router: Router,
    conn_info: ConnInfo,
    streams: Arc<Streams>,
) -> impl hyper::service::Service<
    http::Request<hyper::body::Incoming>,
    Response = http::Response<crate::floor::body::Body>,
    Error = Infallible,
    Future = Answer,
> + Clone {
    service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let guard = streams.open();
        answer(
            router.clone(),
            req.map(crate::floor::body::incoming),
            conn_info,
            guard,
        )
    })
}

/// The future of one request: a box holding the request until it is first
/// polled, and `Router::handle`'s future, boxed then (see `service`). The
/// request's `guard` goes on to its response body.
fn answer(
    router: Router,
    req: http::Request<crate::floor::body::RequestBody>,
    conn: ConnInfo,
    guard: StreamGuard,
) -> Answer {
    Box::pin(async move {
        let handle = Box::pin(router.handle(req, conn));
        let response = handle.await;
        Ok::<_, Infallible>(response.map(|body| counted(body, guard)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> http::Request<crate::floor::body::RequestBody> {
        http::Request::builder()
            .uri("/doc")
            .header("subscribe", "true")
            .body(crate::floor::body::no_request_body())
            .expect("request")
    }

    #[tokio::test]
    async fn a_request_holds_little_until_its_task_polls_it() {
        let config = Config {
            upstream: Some(crate::config::Upstream::parse("http://127.0.0.1:9").expect("url")),
            ..Config::default()
        };
        let router = Router::new(config).expect("router");
        let conn = ConnInfo {
            peer: "127.0.0.1:1".parse().expect("addr"),
            local: "127.0.0.1:2".parse().expect("addr"),
            trusted: true,
        };
        // As an HTTP/2 stream's: counted among its connection's streams.
        let guard = Arc::new(Streams::default()).open();
        let waiting = answer(router.clone(), request(), conn, guard);
        let handle = router.handle(request(), conn);
        let (waiting, whole) = (
            std::mem::size_of_val(&*waiting),
            std::mem::size_of_val(&handle),
        );
        // What an HTTP/2 stream holds between its HEADERS frame and its
        // task's first poll: the request, not `Router::handle`'s state.
        assert!(
            waiting * 3 < whole,
            "{waiting} bytes before the first poll, {whole} for the handler"
        );
    }
}
