//! The request pipeline: filter, route to the Braid side or pass through,
//! and log one access line per request.

use std::sync::Arc;
use std::time::Instant;

use http::{header, Method, Request, Response};
use hyper::body::Incoming;
use tokio::sync::watch;
use tracing::info;

use crate::body::{Body, BoxError};
use crate::config::Config;
use crate::error::Refusal;
use crate::metrics::Metrics;
use crate::proxy::{self, ConnInfo, UpstreamClient};
use crate::resource::{History, Registry, Resource, Tuning};
use crate::subscribe::{self, BraidRequest, Cors, Subscriptions};
use crate::upstream::{self, Watchers};
use crate::writes::{self, Writes};

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
    registry: Arc<Registry>,
    watchers: Arc<Watchers>,
    subscriptions: Subscriptions,
    cors: Cors,
    writes: Writes,
}

impl Router {
    /// Builds the shared state; the configuration must name an upstream.
    pub fn new(mut config: Config) -> Result<Router, BoxError> {
        if config.proxy_id.is_empty() {
            config.proxy_id = crate::config::default_proxy_id(config.listen.port());
        }
        let upstream = config.upstream.clone().ok_or("no upstream configured")?;
        let metrics = Arc::new(Metrics::default());
        let client = UpstreamClient::new(upstream, &config, metrics.clone());
        let (closing, closing_rx) = watch::channel(false);
        let registry = Arc::new(Registry::new(metrics.clone()));
        let history = Arc::new(History::new(config.history_bytes, config.history_len));
        let watchers = Arc::new(Watchers {
            client: client.clone(),
            registry: registry.clone(),
            history: history.clone(),
            tuning: Tuning {
                diff_timeout: config.diff_timeout,
                snapshot_ratio: config.snapshot_ratio,
            },
            metrics: metrics.clone(),
            poll_interval: config.poll_interval,
            resource_idle: config.resource_idle,
            max_body_bytes: config.max_body_bytes,
            response_timeout: config.response_timeout,
            max_header_bytes: config.max_header_bytes,
            upstream_heartbeat: config.upstream_heartbeat,
            closing: closing_rx.clone(),
        });
        let subscriptions = Subscriptions {
            history,
            metrics: metrics.clone(),
            heartbeats: Arc::default(),
            default_heartbeat: config.heartbeat,
            max_total: config.max_subscriptions,
            max_per_resource: config.max_subscriptions_per_resource,
            closing: closing_rx,
        };
        let cors = Cors::new(config.cors_origins.clone());
        let writes = Writes::new(watchers.clone(), &config);
        let inner = Inner {
            config,
            client,
            metrics,
            closing,
            registry,
            watchers,
            subscriptions,
            cors,
            writes,
        };
        Ok(Router {
            inner: Arc::new(inner),
        })
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// The metrics in Prometheus text format, with the gauges read now.
    pub fn render_metrics(&self) -> String {
        let weight = self.inner.watchers.history.weighted_size();
        self.inner
            .metrics
            .history_bytes
            .store(weight as i64, std::sync::atomic::Ordering::Relaxed);
        self.inner.metrics.render()
    }

    /// Tells long-lived streams to end cleanly.
    pub fn begin_shutdown(&self) {
        self.inner.closing.send_replace(true);
    }

    /// A receiver that turns true when the proxy begins to shut down.
    pub fn closing(&self) -> watch::Receiver<bool> {
        self.inner.closing.subscribe()
    }

    /// Revalidates a tracked resource now; false when it is not tracked.
    pub fn refresh(&self, path_and_query: &str) -> bool {
        match self.inner.registry.get(path_and_query) {
            Some(resource) => {
                resource.refresh();
                true
            }
            None => false,
        }
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
        let cors_request = self.inner.cors.enabled().then(|| req.headers().clone());
        let mut response = match self.route(req).await {
            Ok(response) => response,
            Err(refusal) => refusal.into_response(),
        };
        if let Some(headers) = cors_request {
            self.inner.cors.decorate(&headers, &mut response);
        }
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
        let inner = &self.inner;
        let config = &inner.config;
        proxy::request_filter(&req, config)?;
        if let Some(preflight) = inner.cors.preflight(&req) {
            return Ok(preflight);
        }
        if req.uri().path().starts_with("/.well-known/multiplexer") && req.method() == Method::POST
        {
            return Err(Refusal::NoMultiplexing);
        }
        let braid = BraidRequest::parse(req.headers())?;
        let method = req.method().clone();
        match method {
            Method::GET | Method::HEAD if braid.peer_specific => self.pass_through(req).await,
            Method::GET if braid.subscribe => self.subscribe(req, braid).await,
            Method::GET | Method::HEAD if shareable(&req) => self.get(req, braid).await,
            _ if writes::carries_patches(&req) => self.patch_write(req, braid).await,
            Method::PUT | Method::POST | Method::PATCH | Method::DELETE => {
                self.write_through(req).await
            }
            _ => self.pass_through(req).await,
        }
    }

    /// A write passed to the upstream as it is; a 2xx revalidates the resource.
    async fn write_through(&self, req: Request<Incoming>) -> Result<Response<Body>, Refusal> {
        let key = key_of(&req);
        let response = self.pass_through(req).await?;
        if response.status().is_success() {
            // Write-through: revalidate now, so subscribers see the write at once.
            self.refresh(&key);
        }
        Ok(response)
    }

    /// A write carrying Braid patches: as it is to a Braid upstream, else
    /// applied by the proxy (see [`crate::writes`]).
    async fn patch_write(
        &self,
        req: Request<Incoming>,
        braid: BraidRequest,
    ) -> Result<Response<Body>, Refusal> {
        let (resource, _, ()) = self.resource(&req, |_| ())?;
        if resource.braid_upstream() {
            return self.write_through(req).await;
        }
        let inner = &self.inner;
        inner
            .writes
            .apply(req, &braid, resource, &inner.config)
            .await
    }

    async fn pass_through(&self, req: Request<Incoming>) -> Result<Response<Body>, Refusal> {
        proxy::pass_through(req, &self.inner.client, &self.inner.config).await
    }

    /// The resource for a request, starting its watcher when it is new.
    fn resource<T>(
        &self,
        req: &Request<Incoming>,
        with: impl FnOnce(&Arc<Resource>) -> T,
    ) -> Result<(Arc<Resource>, bool, T), Refusal> {
        let key = key_of(req);
        let via = proxy::via_chain(req.headers(), &self.inner.config.proxy_id)
            .ok_or_else(|| Refusal::BadRequest("malformed Via header".into()))?;
        let (resource, created, t) = self.inner.registry.get_or_create(&key, with);
        if created {
            tokio::spawn(self.inner.watchers.clone().watch(resource.clone(), via));
        }
        Ok((resource, created, t))
    }

    /// Waits (bounded) for the first state of a new resource, or a fresh one.
    async fn fresh(&self, resource: &Resource, created: bool) {
        let config = &self.inner.config;
        let v = resource.validation();
        let fresh = !created
            && !v.stale
            && !v.failed
            && (v.live || v.at.is_some_and(|at| at.elapsed() < config.poll_interval))
            && resource.head().seq > 0;
        if !fresh {
            if !created {
                resource.wake.notify_one();
            }
            let limit = config.response_timeout + config.connect_timeout;
            upstream::await_validation(resource, v.generation, limit).await;
        }
    }

    async fn subscribe(
        &self,
        req: Request<Incoming>,
        braid: BraidRequest,
    ) -> Result<Response<Body>, Refusal> {
        let (resource, created, rx) = self.resource(&req, |r| r.subscribe())?;
        if !created && resource.subscribers() == 1 {
            // The first subscriber of a resource plain GETs made: ask the
            // upstream for a subscription now rather than at the next poll.
            resource.wake.notify_one();
        }
        if resource.head().seq == 0 {
            self.fresh(&resource, created).await;
        }
        if resource.head().seq == 0 {
            return Err(Refusal::UpstreamBroken(
                "no state for this resource yet: the origin could not be reached or gave an unusable answer".into(),
            ));
        }
        self.inner.subscriptions.respond(resource, rx, &braid)
    }

    async fn get(
        &self,
        req: Request<Incoming>,
        braid: BraidRequest,
    ) -> Result<Response<Body>, Refusal> {
        let (resource, created, ()) = self.resource(&req, |_| ())?;
        self.fresh(&resource, created).await;
        let head = resource.head();
        if resource.validation().failed || head.seq == 0 {
            return self.pass_through(req).await;
        }
        if let Some(wanted) = &braid.version {
            if *wanted != head.version {
                return Err(Refusal::VersionUnavailable(wanted.to_header_value()));
            }
        }
        match subscribe::serve_state(&req, &head) {
            Some(response) => Ok(response),
            None => self.pass_through(req).await,
        }
    }
}

/// The registry key of a request: its path and query.
fn key_of<B>(req: &Request<B>) -> String {
    req.uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string()
}

/// A GET may be answered from the shared state only when nothing in it
/// personalises the answer: no credentials, no ranges, no conditional
/// request other than If-None-Match.
fn shareable<B>(req: &Request<B>) -> bool {
    let h = req.headers();
    ![
        header::AUTHORIZATION,
        header::COOKIE,
        header::RANGE,
        header::IF_MATCH,
        header::IF_RANGE,
    ]
    .iter()
    .any(|name| h.contains_key(name))
}
