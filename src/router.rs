//! The request pipeline: filter, route to the Braid side or pass through,
//! and log one access line per request.

use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::sync::watch;
use tracing::info;

use crate::body::{Body, BoxError};
use crate::config::Config;
use crate::error::Refusal;
use crate::metrics::Metrics;
use crate::proxy::{self, ConnInfo, UpstreamClient};

/// The proxy's shared state, a cheap clonable handle.
#[derive(Clone)]
pub struct Router {
    inner: Arc<Inner>,
}

struct Inner {
    config: Config,
    client: UpstreamClient,
    metrics: Arc<Metrics>,
    closing: watch::Sender<bool>,
}

impl Router {
    /// Builds the shared state; the configuration must name an upstream.
    pub fn new(config: Config) -> Result<Router, BoxError> {
        let upstream = config.upstream.clone().ok_or("no upstream configured")?;
        let metrics = Arc::new(Metrics::default());
        let client = UpstreamClient::new(upstream, &config, metrics.clone());
        let (closing, _) = watch::channel(false);
        Ok(Router {
            inner: Arc::new(Inner {
                config,
                client,
                metrics,
                closing,
            }),
        })
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// Tells long-lived streams to end cleanly.
    pub fn begin_shutdown(&self) {
        self.inner.closing.send_replace(true);
    }

    /// A receiver that turns `true` when the proxy shuts down.
    pub fn closing(&self) -> watch::Receiver<bool> {
        self.inner.closing.subscribe()
    }

    /// Revalidates a tracked resource now; false when it is not tracked.
    pub fn refresh(&self, _path: &str) -> bool {
        false
    }

    /// Handles one client request; never fails, errors become responses.
    pub async fn handle(&self, mut req: Request<Incoming>, conn: ConnInfo) -> Response<Body> {
        let started = Instant::now();
        Metrics::inc(&self.inner.metrics.requests_total);
        req.extensions_mut().insert(conn);
        let method = req.method().clone();
        let target = req
            .uri()
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default();
        let version = req.version();
        let response = match self.route(req).await {
            Ok(response) => response,
            Err(refusal) => refusal.into_response(),
        };
        info!(
            target: "access",
            peer = %conn.peer,
            "{method} {target} {version:?} {} {:.1}ms",
            response.status().as_u16(),
            started.elapsed().as_secs_f64() * 1000.0
        );
        response
    }

    async fn route(&self, req: Request<Incoming>) -> Result<Response<Body>, Refusal> {
        let config = &self.inner.config;
        proxy::request_filter(&req, config)?;
        proxy::pass_through(req, &self.inner.client, config).await
    }
}
