//! Listeners and connections: the accept loops, hyper-util's auto builder
//! (HTTP/1.1 and h2c with prior knowledge), the timer that makes the
//! header-read timeout work, per-connection limits, and graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};

use crate::admin;
use crate::body::BoxError;
use crate::config::Config;
use crate::proxy::ConnInfo;
use crate::router::Router;

/// Write-buffer bound per connection: hyper stops pulling a response body
/// once this much is queued, which is what makes slow readers cheap.
const CONNECTION_WRITE_BUFFER: usize = 16 * 1024;

/// A bound but not yet running proxy. Binding first lets callers (and tests)
/// learn the addresses, including port 0 ones, before serving.
pub struct Server {
    config: Config,
    listener: TcpListener,
    admin: Option<TcpListener>,
}

impl Server {
    /// Binds the client listener and, if configured, the admin listener.
    pub async fn bind(config: Config) -> std::io::Result<Server> {
        let listener = TcpListener::bind(config.listen).await?;
        let admin = match config.admin_listen {
            Some(addr) => Some(TcpListener::bind(addr).await?),
            None => None,
        };
        Ok(Server {
            config,
            listener,
            admin,
        })
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
        } = self;
        let grace = config.shutdown_grace;
        let router = Router::new(config)?;
        let graceful = GracefulShutdown::new();
        let builder = Arc::new(connection_builder(router.config()));

        let admin_task = admin.map(|admin_listener| {
            let router = router.clone();
            tokio::spawn(admin::serve(admin_listener, router))
        });

        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => serve_connection(stream, peer, &builder, &router, &graceful),
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
        drop(listener);
        info!("shutting down: ending subscription streams, draining in-flight requests");
        router.begin_shutdown();
        if let Some(task) = admin_task {
            task.abort();
        }
        if tokio::time::timeout(grace, graceful.shutdown())
            .await
            .is_err()
        {
            warn!(
                ?grace,
                "grace period over; closing the remaining connections"
            );
        }
        Ok(())
    }
}

fn connection_builder(config: &Config) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout)
        .max_headers(config.max_headers)
        .max_buf_size(CONNECTION_WRITE_BUFFER.max(config.max_header_bytes + 1024));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(config.max_header_bytes as u32)
        .max_send_buf_size(CONNECTION_WRITE_BUFFER)
        .max_concurrent_streams(config.max_streams_per_connection)
        .keep_alive_interval(Some(Duration::from_secs(30)));
    builder
}

fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    builder: &Arc<auto::Builder<TokioExecutor>>,
    router: &Router,
    graceful: &GracefulShutdown,
) {
    let _ = stream.set_nodelay(true);
    let local = match stream.local_addr() {
        Ok(local) => local,
        Err(_) => return,
    };
    let conn_info = ConnInfo { peer, local };
    let router = router.clone();
    // The request future is boxed: hyper keeps a slot of the service
    // future's size for the whole connection, and `Router::handle` is a few
    // KiB, which an idle subscription would otherwise hold for nothing.
    let service = service_fn(move |req| {
        let router = router.clone();
        Box::pin(async move { Ok::<_, Infallible>(router.handle(req, conn_info).await) })
    });
    let builder = builder.clone();
    let watcher = graceful.watcher();
    tokio::spawn(async move {
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        if let Err(e) = watcher.watch(conn).await {
            debug!(%peer, error = %e, "connection ended with an error");
        }
    });
}
