//! The request pipeline: filter, route to the Braid side or pass through,
//! and log one access line per request.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{header, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use tokio::sync::watch;
use tracing::info;

use crate::body::{self, Body, BoxError, RequestBody};
use crate::cache::{self, Reuse, Timing};
use crate::config::{Config, MultiplexMode, UpstreamKind};
use crate::error::Refusal;
use crate::metrics::Metrics;
use crate::multiplex::{self, Multiplexers};
use crate::proxy::{self, ConnInfo, UpstreamClient};
use crate::relay::{Relayed, Relays};
use crate::resource::{
    History, Key, Kind, Registry, RegistryLimits, Resource, State, Ticket, Tuning,
};
use crate::subscribe::{self, BraidRequest, CacheOutcome, Cors, Subscriptions};
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
    relays: Arc<Relays>,
    subscriptions: Subscriptions,
    cors: Cors,
    writes: Writes,
    multiplexers: Multiplexers,
    /// Bytes of origin answers being copied into state while they stream.
    copies: Arc<body::CopyBudget>,
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
        let registry = Arc::new(Registry::new(
            metrics.clone(),
            RegistryLimits {
                state_bytes: config.state_bytes,
                max_private: config.max_private_resources,
            },
        ));
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
            closing: closing_rx.clone(),
        });
        let relays = Arc::new(Relays::new(
            client.clone(),
            config.clone(),
            metrics.clone(),
            registry.clone(),
            closing_rx.clone(),
        ));
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
        let state_bytes = config.state_bytes;
        let copies = Arc::new(body::CopyBudget::new(state_bytes / 4));
        // Every byte held counts against --state-bytes: windows, relayed
        // windows, and copies of answers being stored.
        let windows = watchers.history.clone();
        registry.count_also(move || usize::try_from(windows.weighted_size()).unwrap_or(usize::MAX));
        let relayed = relays.window_counter();
        registry.count_also(move || relayed.load(std::sync::atomic::Ordering::Relaxed));
        let in_flight = copies.clone();
        registry.count_also(move || in_flight.used());
        let multiplexers = Multiplexers::new(multiplex::Limits {
            max_multiplexers: config.max_multiplexers,
            max_requests: config.max_multiplexed_requests,
            idle: config.multiplexer_idle,
            ..multiplex::Limits::default()
        });
        let inner = Inner {
            config,
            client,
            metrics,
            closing,
            registry,
            watchers,
            relays,
            subscriptions,
            cors,
            writes,
            multiplexers,
            copies,
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

    /// What the operator's page shows, read now ([`crate::status`]);
    /// `started` is when the admin listener started.
    pub fn status(&self, started: Instant) -> crate::status::Status {
        let inner = &self.inner;
        let sources = crate::status::Sources {
            config: &inner.config,
            metrics: &inner.metrics,
            registry: &inner.registry,
            relays: &inner.relays,
            history: &inner.watchers.history,
            health: &inner.client.health,
        };
        crate::status::Status::read(sources, started)
    }

    /// The metrics in Prometheus text format, with the gauges read now.
    pub fn render_metrics(&self) -> String {
        let weight = self.inner.watchers.history.weighted_size();
        let metrics = &self.inner.metrics;
        metrics
            .history_bytes
            .store(weight as i64, std::sync::atomic::Ordering::Relaxed);
        metrics.state_bytes.store(
            self.inner.registry.state_bytes() as i64,
            std::sync::atomic::Ordering::Relaxed,
        );
        metrics.resources_private.store(
            self.inner.registry.private_count() as i64,
            std::sync::atomic::Ordering::Relaxed,
        );
        let mut out = self.inner.metrics.render();
        let _ = writeln!(
            out,
            "# HELP braid_proxy_history_evictions_total Steps evicted from the history windows to keep them under --history-bytes.\n# TYPE braid_proxy_history_evictions_total counter\nbraid_proxy_history_evictions_total {}",
            self.inner.watchers.history.evictions()
        );
        // How long ago each subscribed resource was last known current, as
        // one histogram (a series per URL would not be bounded).
        let ages = crate::metrics::Histogram::new(crate::metrics::AGE_BUCKETS);
        for resource in self.inner.registry.all() {
            if resource.subscribers() == 0 {
                continue;
            }
            let v = resource.validation();
            let age = v
                .ok_at
                .map_or(f64::INFINITY, |at| at.elapsed().as_secs_f64());
            ages.observe(age);
        }
        ages.render(
            &mut out,
            "validation_age_seconds",
            "Per subscribed resource: seconds since its state was last validated (0 while a Braid upstream stream is live).",
        );
        out
    }

    /// Whether this proxy can serve: `Err` with the reason when the
    /// upstream's latest answer was a failure, or when a subscribed
    /// resource has had neither a successful poll nor a live upstream
    /// stream for three poll intervals (its watcher is wedged or failing).
    pub fn readiness(&self) -> Result<(), String> {
        if let Some(reason) = self.inner.client.health.down() {
            return Err(format!("upstream unreachable: {reason}"));
        }
        let limit = self.inner.config.poll_interval.max(Duration::from_secs(1)) * 3;
        let stuck = self
            .inner
            .registry
            .all()
            .into_iter()
            .filter(|r| r.subscribers() > 0)
            .filter(|r| {
                let v = r.validation();
                v.ok_at.map_or(true, |at| at.elapsed() > limit)
            })
            .count();
        if stuck > 0 {
            return Err(format!(
                "{stuck} subscribed resource(s) without a successful poll or live upstream stream for {limit:?}"
            ));
        }
        Ok(())
    }

    /// Probes the upstream (a TCP connect) when nothing has reached it
    /// lately, so readiness follows the upstream without client traffic.
    pub async fn probe_upstream(&self) {
        let config = &self.inner.config;
        let every = config
            .poll_interval
            .clamp(Duration::from_millis(250), Duration::from_secs(5));
        let recent = self
            .inner
            .client
            .health
            .snapshot()
            .last_ok
            .is_some_and(|at| at.elapsed() < every);
        if !recent || self.inner.client.health.down().is_some() {
            self.inner.client.probe(config.connect_timeout).await;
        }
    }

    /// Tells long-lived streams to end cleanly.
    pub fn begin_shutdown(&self) {
        self.inner.closing.send_replace(true);
        self.inner.multiplexers.close_all();
    }

    /// A receiver that turns true when the proxy begins to shut down.
    pub fn closing(&self) -> watch::Receiver<bool> {
        self.inner.closing.subscribe()
    }

    /// Invalidates every tracked variant of a URL: stored answers are
    /// revalidated before reuse, and watchers revalidate now. False when
    /// the URL is not tracked.
    pub fn refresh(&self, path_and_query: &str) -> bool {
        let variants = self.inner.registry.variants(path_and_query);
        for resource in &variants {
            resource.invalidate();
            resource.refresh();
        }
        !variants.is_empty()
    }

    /// Handles one client request; never fails, errors become responses.
    pub async fn handle(&self, mut req: Request<RequestBody>, conn: ConnInfo) -> Response<Body> {
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
        // Every answer names this proxy in Via (RFC 9110 §7.6.3): passed
        // through, served from state, a 209, or the proxy's own error.
        self.name_in_via(&mut response);
        info!(
            target: "access",
            peer = %conn.peer,
            "{method} {target} {version:?} {} {:.1}ms",
            response.status().as_u16(),
            started.elapsed().as_secs_f64() * 1000.0
        );
        response
    }

    fn name_in_via(&self, response: &mut Response<Body>) {
        let proxy_id = &self.inner.config.proxy_id;
        if !proxy::via_names(response.headers(), proxy_id) {
            proxy::append_via(response.headers_mut(), http::Version::HTTP_11, proxy_id);
        }
    }

    async fn route(&self, req: Request<RequestBody>) -> Result<Response<Body>, Refusal> {
        let inner = &self.inner;
        let config = &inner.config;
        proxy::request_filter(&req, config)?;
        if let Some(preflight) = inner.cors.preflight(&req) {
            return Ok(preflight);
        }
        if config.multiplex == MultiplexMode::Relay && multiplex::is_multiplexing(&req) {
            // The upstream's own multiplexer serves these (spec/multiplex.md).
            return self.pass_through(req).await;
        }
        if let Some(intent) = multiplex::classify(&req, inner.multiplexers.limits())? {
            return self.multiplexed(req, intent).await;
        }
        let braid = BraidRequest::parse(req.headers())?;
        let method = req.method().clone();
        match method {
            Method::GET | Method::HEAD if braid.peer_specific => self.pass_through(req).await,
            Method::GET if braid.subscribe => self.subscribe(req, braid).await,
            Method::GET | Method::HEAD => self.get(req, braid).await,
            Method::OPTIONS | Method::TRACE => self.pass_through(req).await,
            _ if writes::carries_patches(&req) => self.patch_write(req, braid).await,
            _ => self.unsafe_method(req).await,
        }
    }

    /// A multiplexer request, or a request answered through a multiplexer:
    /// routed as any other request (without its multiplexing headers), its
    /// response put into the multiplexer and a 293 answered here; a 5xx or
    /// an upstream's own 293 is answered directly instead (see
    /// [`multiplex::belongs_inside`]).
    async fn multiplexed(
        &self,
        mut req: Request<RequestBody>,
        intent: multiplex::Intent,
    ) -> Result<Response<Body>, Refusal> {
        let multiplexers = &self.inner.multiplexers;
        match intent {
            multiplex::Intent::Create(id) => multiplexers.create(id),
            multiplex::Intent::Delete { mux, request } => {
                multiplexers.delete(&mux, request.as_deref())
            }
            multiplex::Intent::Through { mux, request } => {
                let reservation = multiplexers.reserve(&mux, &request).await?;
                multiplex::strip(&mut req);
                let mut response = match Box::pin(self.route(req)).await {
                    Ok(response) => response,
                    Err(refusal) => refusal.into_response(),
                };
                self.name_in_via(&mut response);
                if !multiplex::belongs_inside(response.status()) {
                    // Answered as is, outside the multiplexer; dropping the
                    // reservation frees the request id.
                    drop(reservation);
                    return Ok(response);
                }
                Ok(reservation.attach(response))
            }
        }
    }

    /// The registry key of a request (its variant), and the host it named.
    fn request_key<B>(&self, req: &Request<B>) -> (Key, String) {
        let host = proxy::request_host(req).unwrap_or_default();
        let key = self
            .inner
            .registry
            .key_for(&key_of(req), req.headers(), &host);
        (key, host)
    }

    /// A write carrying Braid patches: as it is to a Braid upstream, else
    /// applied by the proxy (see [`crate::writes`]).
    async fn patch_write(
        &self,
        req: Request<RequestBody>,
        braid: BraidRequest,
    ) -> Result<Response<Body>, Refusal> {
        let inner = &self.inner;
        let (key, _) = self.request_key(&req);
        let path = key.path.clone();
        if self.kind_of(&key) == Kind::Braid {
            return self.unsafe_method(req).await;
        }
        let (resource, _, ()) = inner.registry.get_or_create(
            &key,
            || proxy::watcher_template(&req, &inner.config),
            |_| (),
        )?;
        if inner.config.upstream_kind == UpstreamKind::Auto && resource.kind() == Kind::Unknown {
            // Learn what this resource's upstream is (one GET) before
            // applying patches a Braid server would apply itself.
            if self.learn_kind(&resource).await == Kind::Braid {
                return self.unsafe_method(req).await;
            }
        }
        let response = inner
            .writes
            .apply(req, &braid, resource.clone(), &inner.config)
            .await?;
        if response.status().is_success() {
            // Stored answers of every variant are older than the write now,
            // and so are answers to requests sent before it.
            for variant in inner.registry.variants(&path) {
                variant.landed();
                variant.invalidate();
                if !Arc::ptr_eq(&variant, &resource) {
                    variant.refresh();
                }
            }
        }
        Ok(response)
    }

    async fn pass_through(&self, req: Request<RequestBody>) -> Result<Response<Body>, Refusal> {
        proxy::pass_through(req, &self.inner.client, &self.inner.config).await
    }

    /// What the upstream of the resource `key` names is: forced by
    /// `--upstream-kind`, else as its own answers told (a live relayed
    /// subscription of the URL says Braid).
    fn kind_of(&self, key: &Key) -> Kind {
        let inner = &self.inner;
        match inner.config.upstream_kind {
            UpstreamKind::Braid => Kind::Braid,
            UpstreamKind::Rest => Kind::Plain,
            UpstreamKind::Auto
                if inner.registry.is_braid(&key.path) || inner.relays.has_live(&key.path) =>
            {
                Kind::Braid
            }
            UpstreamKind::Auto => inner.registry.get(key).map_or(Kind::Unknown, |r| r.kind()),
        }
    }

    /// Asks the upstream for `resource` once (a GET with its template
    /// headers) to learn whether it speaks Braid; the body is not read.
    async fn learn_kind(&self, resource: &Resource) -> Kind {
        let inner = &self.inner;
        let Ok(req) = inner.watchers.plain_get(resource, None) else {
            return Kind::Unknown;
        };
        match inner.client.send_watch(req).await {
            Ok(response) if crate::relay::braid_signs(response.headers()) => {
                resource.learn_kind(Kind::Braid);
                inner.registry.learn_braid(resource.key());
            }
            Ok(response) if response.status() == StatusCode::OK => resource.learn_kind(Kind::Plain),
            _ => {}
        }
        resource.kind()
    }

    /// An unsafe (or unknown) method: forwarded; a non-error answer
    /// invalidates the URL, and the same-origin `Location` and
    /// `Content-Location` it names (RFC 9111 §4.4), and revalidates their
    /// watchers at once (write-through).
    async fn unsafe_method(&self, req: Request<RequestBody>) -> Result<Response<Body>, Refusal> {
        let path = key_of(&req);
        let host = proxy::request_host(&req);
        let response = self.pass_through(req).await?;
        let status = response.status();
        if status.is_success() || status.is_redirection() {
            self.inner.relays.written(&path);
            // Answers to requests sent before the write landed may show
            // the document before it: not recorded (Resource::record).
            for variant in self.inner.registry.variants(&path) {
                variant.landed();
            }
            self.refresh(&path);
            for name in [header::LOCATION, header::CONTENT_LOCATION] {
                if let Some(target) = response
                    .headers()
                    .get(name)
                    .and_then(|v| same_origin_target(v, host.as_deref()))
                {
                    self.refresh(&target);
                }
            }
        }
        Ok(response)
    }

    async fn subscribe(
        &self,
        req: Request<RequestBody>,
        braid: BraidRequest,
    ) -> Result<Response<Body>, Refusal> {
        let inner = &self.inner;
        let headers = req.headers().clone();
        let (key, host) = self.request_key(&req);
        let path = key.path.clone();
        // A Braid upstream (or one not known yet) gets the client's own
        // request; a plain origin's first answer seeds the polled resource.
        // `Poll`: an equivalent request's answer just showed a plain
        // origin; that request seeds the resource, this one waits for it.
        let kind = self.kind_of(&key);
        let (template, mut seed) = if kind != Kind::Plain {
            match inner
                .relays
                .subscribe(req, &braid, kind == Kind::Braid)
                .await?
            {
                Relayed::Answer(response) => return Ok(response),
                Relayed::Plain {
                    template,
                    response,
                    timing,
                    ticket,
                    seeding,
                } => (template, Some((response, (timing, ticket), seeding))),
                Relayed::Poll { template } => (template, None),
            }
        } else {
            (proxy::watcher_template(&req, &inner.config), None)
        };
        let limit = inner.config.response_timeout + inner.config.connect_timeout;
        // Twice at most: the first answer may name a `Vary` under which
        // this request is another variant than the resource it waited on.
        let mut attempts = 0;
        let (resource, rx, created) = loop {
            attempts += 1;
            let key = inner.registry.key_for(&path, &headers, &host);
            let (resource, created, rx) =
                inner
                    .registry
                    .get_or_create(&key, || template.clone(), |r| r.subscribe())?;
            let seeded = seed.is_some();
            // The seeding request holds the watcher while it seeds, so that
            // nobody polls before that first answer is in.
            let mut claimed = seeded && inner.registry.claim_watcher(&resource);
            if let Some((response, (timing, ticket), seeding)) = seed.take() {
                if response.status() == StatusCode::OK {
                    resource.learn_kind(Kind::Plain);
                }
                inner
                    .watchers
                    .seed(&resource, response, timing, ticket)
                    .await;
                drop(seeding);
                if created {
                    // Its first state may have put the proxy over --state-bytes.
                    inner.registry.refuse_if_full(&resource)?;
                }
            }
            let generation = resource.validation().generation;
            if !seeded {
                claimed = inner.registry.claim_watcher(&resource);
            }
            if claimed {
                tokio::spawn(inner.watchers.clone().watch(resource.clone(), seeded));
            } else if resource.subscribers() == 1 {
                // The first subscriber of a watched resource: poll now rather
                // than at the next interval.
                resource.wake.notify_one();
            }
            // A seed that gave no state (a coded body, say) is followed by
            // the watcher's own poll at once; a refused one is final.
            if resource.head().seq == 0 && resource.refusal().is_none() {
                if seeded {
                    resource.wake.notify_one();
                }
                upstream::await_validation(&resource, generation, limit).await;
            }
            // Another request's answer seeded it: is it this request's variant?
            let rekeyed = inner.registry.key_for(&path, &headers, &host) != key;
            if seeded || claimed || !rekeyed || attempts == 2 {
                break (resource, rx, created);
            }
        };
        if created {
            // Its first state may have put the proxy over --state-bytes.
            inner.registry.refuse_if_full(&resource)?;
        }
        if resource.head().seq == 0 {
            return Err(resource.refusal().unwrap_or_else(|| Refusal::UpstreamBroken(
                "no state for this resource yet: the origin could not be reached or gave an unusable answer".into(),
            )));
        }
        inner.subscriptions.respond(resource, rx, &braid)
    }

    /// A plain GET or HEAD, answered as a shared cache would (RFC 9111):
    /// from stored state where it is fresh for this request, after a
    /// revalidation where it is not, and from the origin otherwise, whose
    /// answer then seeds the state.
    async fn get(
        &self,
        req: Request<RequestBody>,
        braid: BraidRequest,
    ) -> Result<Response<Body>, Refusal> {
        let inner = &self.inner;
        let request_cc = cache::request_cache_control(req.headers());
        let h = req.headers();
        let bypass = request_cc.no_store
            || [
                header::RANGE,
                header::IF_MATCH,
                header::IF_UNMODIFIED_SINCE,
                header::IF_RANGE,
            ]
            .iter()
            .any(|name| h.contains_key(name));
        if bypass {
            // Ranges and preconditions other than If-None-Match and
            // If-Modified-Since are the origin's to evaluate.
            let response = self.pass_through(req).await?;
            return Ok(with_cache_status(
                response,
                &inner.config.proxy_id,
                "fwd=bypass",
            ));
        }
        let (mut key, host) = self.request_key(&req);
        if braid.version.is_none() && braid.parents.is_none() {
            // A live upstream subscription of this variant validates its model.
            if let Some(response) = inner.relays.answer_live(&req, &key, &inner.config.proxy_id) {
                return Ok(response);
            }
        }
        let kind = self.kind_of(&key);
        if kind != Kind::Plain {
            // A Braid server's answer depends on the version asked for
            // (`Vary: Version, Parents`, whether it says so or not).
            for (name, value) in [("version", &braid.version), ("parents", &braid.parents)] {
                if let Some(v) = value {
                    let _ = write!(key.secondary, "\n{name}:{}", v.to_header_value());
                }
            }
        }
        let resource = inner.registry.get(&key);
        if let Some(resource) = &resource {
            if let Some(response) =
                self.answer_from_state(&req, &braid, resource, &request_cc, false)
            {
                return Ok(response);
            }
        }
        if braid.version.is_some() && kind == Kind::Plain {
            // A version the proxy does not hold: the origin's to answer.
            let response = self.pass_through(req).await?;
            return Ok(with_cache_status(
                response,
                &inner.config.proxy_id,
                "fwd=miss; detail=\"version not held\"",
            ));
        }
        if request_cc.only_if_cached {
            return Ok(only_if_cached_miss());
        }
        let guard = match &resource {
            Some(resource)
                if !resource
                    .uncacheable
                    .load(std::sync::atomic::Ordering::Relaxed) =>
            {
                let arrived = resource.validation().generation;
                let lock = resource.fetching.clone().lock_owned();
                let guard = tokio::time::timeout(inner.config.response_timeout, lock)
                    .await
                    .ok();
                // Another request fetched while this one waited: its answer may do.
                if resource.validation().generation != arrived {
                    if let Some(response) =
                        self.answer_from_state(&req, &braid, resource, &request_cc, true)
                    {
                        return Ok(response);
                    }
                }
                guard
            }
            _ => None,
        };
        self.fetch(req, key, host, resource, guard).await
    }

    /// The stored answer, if it may answer this request without the origin.
    fn answer_from_state<B>(
        &self,
        req: &Request<B>,
        braid: &BraidRequest,
        resource: &Resource,
        request_cc: &cache::CacheControl,
        validated_since_arrival: bool,
    ) -> Option<Response<Body>> {
        let stored = resource.stored().filter(|s| !s.invalid)?;
        let head = resource.head();
        if let Some(wanted) = &braid.version {
            if stored.version.as_ref() != Some(wanted) {
                return None;
            }
        }
        // Never older than the newest version the proxy knows.
        if stored.version.as_ref().is_some_and(|v| *v != head.version) {
            return None;
        }
        let outcome = if validated_since_arrival {
            // The origin answered while this request waited for that fetch:
            // its answer is as current as one this request would get.
            CacheOutcome::Revalidated
        } else {
            let now = std::time::SystemTime::now();
            match cache::reuse(
                stored.status,
                &stored.headers,
                stored.timing,
                request_cc,
                now,
            ) {
                Reuse::Fresh { ttl } => CacheOutcome::Hit { ttl },
                Reuse::Revalidate => return None,
            }
        };
        Metrics::inc(&self.inner.metrics.cache_hits_total);
        Some(subscribe::serve_stored(
            req,
            &stored,
            &head,
            outcome,
            &self.inner.config.proxy_id,
        ))
    }

    /// Sends a GET to the origin for a stored answer that cannot be reused
    /// (a conditional request with its validators) or for none, and stores
    /// what comes back where RFC 9111 allows: a 304 refreshes the stored
    /// answer; a storable answer is streamed to the client as it is stored.
    fn fetch(
        &self,
        req: Request<RequestBody>,
        key: Key,
        host: String,
        resource: Option<Arc<Resource>>,
        guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    ) -> impl std::future::Future<Output = Result<Response<Body>, Refusal>> + Send + 'static {
        fetch(self.inner.clone(), req, key, host, resource, guard)
    }
}

/// See [`Router::fetch`].
async fn fetch(
    inner: Arc<Inner>,
    req: Request<RequestBody>,
    key: Key,
    host: String,
    resource: Option<Arc<Resource>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
) -> Result<Response<Body>, Refusal> {
    let config = &inner.config;
    let request_cc = cache::request_cache_control(req.headers());
    let stored = resource.as_ref().and_then(|r| r.stored());
    let mut probe = Request::new(());
    *probe.method_mut() = req.method().clone();
    *probe.headers_mut() = req.headers().clone();
    let template = proxy::watcher_template(&req, config);
    let credentials = req.headers().contains_key(header::AUTHORIZATION);
    let mut out = proxy::upstream_request(req, &inner.client, config)?;
    let validators = stored.as_ref().map(|s| {
        (
            s.headers.get(header::ETAG).cloned(),
            s.headers.get(header::LAST_MODIFIED).cloned(),
        )
    });
    let revalidating = matches!(validators, Some((Some(_), _)) | Some((_, Some(_))));
    if let (true, Some((etag, modified))) = (revalidating, validators.clone()) {
        let h = out.headers_mut();
        h.remove(header::IF_NONE_MATCH);
        h.remove(header::IF_MODIFIED_SINCE);
        if let Some(etag) = etag {
            h.insert(header::IF_NONE_MATCH, etag);
        }
        if let Some(modified) = modified {
            h.insert(header::IF_MODIFIED_SINCE, modified);
        }
    }
    let sent = std::time::SystemTime::now();
    let ticket = Ticket::take();
    let response = inner.client.send(out).await?;
    // A Braid server names its versions: the proxy adds none of its own
    // (issue 19), and the resource is known to be a Braid server's.
    let braid_answer = crate::relay::braid_signs(response.headers())
        || config.upstream_kind == UpstreamKind::Braid
        || inner.registry.is_braid(&key.path);
    let timing = Timing {
        request_time: sent,
        response_time: std::time::SystemTime::now(),
    };
    let status = response.status();
    if let (true, StatusCode::NOT_MODIFIED, Some(resource)) = (revalidating, status, &resource) {
        let (etag, modified) = validators.unwrap_or_default();
        // A 304 about an answer no longer stored (a newer one was recorded
        // meanwhile) merges nothing; the client gets the newer one.
        let asked = (ticket, etag.as_ref(), modified.as_ref());
        inner
            .watchers
            .not_modified(resource, response.headers(), timing, asked);
        resource.validated(true);
        Metrics::inc(&inner.metrics.cache_revalidated_total);
        if let Some(stored) = resource.stored() {
            let head = resource.head();
            return Ok(subscribe::serve_stored(
                &probe,
                &stored,
                &head,
                CacheOutcome::Revalidated,
                &config.proxy_id,
            ));
        }
    }
    let fwd = if stored.is_some() {
        "stale"
    } else if resource.is_some() {
        "miss"
    } else {
        "uri-miss"
    };
    let not_stored = if probe.method() == Method::HEAD {
        Some("head")
    } else {
        cache::unstorable(&request_cc, status, response.headers(), credentials)
    };
    let declared = response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let not_stored = not_stored.or_else(|| {
        declared
            .is_some_and(|n| n > config.max_body_bytes)
            .then_some("too large")
    });
    // The copy kept while the answer streams through counts against a
    // budget shared by all requests in flight; over it, the answer is only
    // passed on.
    let copy_limit = declared.unwrap_or(config.max_body_bytes);
    let copy = match not_stored {
        None => inner.copies.reserve(copy_limit),
        Some(_) => None,
    };
    let not_stored = not_stored.or_else(|| copy.is_none().then_some("busy"));
    let mut response = proxy::downstream_response(response, config);
    let target: Result<Arc<Resource>, &'static str> = match not_stored {
        Some(reason) => Err(reason),
        None => {
            let vary = cache::vary(response.headers());
            let key = inner
                .registry
                .learn_vary(&key.path, &vary, probe.headers(), &host);
            inner
                .registry
                .get_or_create(&key, || template, |_| ())
                .map(|(r, _, ())| r)
                .map_err(|_| match inner.registry.is_full() {
                    true => "state full",
                    false => "private cap",
                })
        }
    };
    let detail = match target {
        Err(reason) => {
            if let Some(resource) = &resource {
                resource
                    .uncacheable
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
            Metrics::inc(&inner.metrics.cache_not_stored_total);
            format!(
                "fwd={fwd}; fwd-status={}; detail=\"not stored: {reason}\"",
                status.as_u16()
            )
        }
        Ok(target) => {
            let headers = response.headers().clone();
            let encoded = headers.contains_key(header::CONTENT_ENCODING);
            // The version this answer will have: the head's when it is the
            // head's ETag (a written version keeps the writer's id).
            let head = target.head();
            let same_etag = matches!(&head.state, State::Present { etag: Some(e), .. }
                if headers.get(header::ETAG).is_some_and(|v| v.as_bytes() == e.as_bytes()));
            if braid_answer {
                target.learn_kind(Kind::Braid);
                inner.registry.learn_braid(&key.path);
            }
            let announced = if same_etag {
                Some(head.version.clone())
            } else {
                crate::resource::announced_version(&headers)
            }
            .filter(|_| status == StatusCode::OK && !encoded && !braid_answer);
            if status == StatusCode::OK
                && !encoded
                && !braid_answer
                && announced.is_none()
                && declared.is_some()
            {
                // The version is a hash of the body: read it (it is
                // within max-body-bytes) so this answer can name it.
                Metrics::inc(&inner.metrics.cache_misses_total);
                let held = fetch_whole(
                    inner.clone(),
                    response,
                    probe,
                    target,
                    (timing, ticket),
                    fwd,
                    guard,
                );
                let answer = held.await;
                drop(copy);
                return answer;
            }
            if let Some(v) =
                announced.and_then(|v| HeaderValue::from_str(&v.to_header_value()).ok())
            {
                let h = response.headers_mut();
                h.insert(HeaderName::from_static("version"), v.clone());
                h.insert(HeaderName::from_static("current-version"), v);
            }
            if status == StatusCode::NO_CONTENT || declared == Some(0) {
                // No body to wait for (a 204's is never polled).
                inner.watchers.absorb_fetched(
                    &target,
                    status,
                    &headers,
                    bytes::Bytes::new(),
                    (timing, ticket),
                    true,
                );
                target.validated(true);
                drop(guard);
                Metrics::inc(&inner.metrics.cache_misses_total);
                let detail = format!("fwd={fwd}; fwd-status={}; stored", status.as_u16());
                return Ok(with_cache_status(response, &config.proxy_id, &detail));
            }
            let watchers = inner.watchers.clone();
            let body = std::mem::replace(response.body_mut(), body::empty());
            let done: body::OnComplete = Box::new(move |bytes| {
                watchers.absorb_fetched(&target, status, &headers, bytes, (timing, ticket), true);
                target.validated(true);
            });
            *response.body_mut() = body::tee(body, copy_limit, (guard, copy), done);
            format!("fwd={fwd}; fwd-status={}; stored", status.as_u16())
        }
    };
    Metrics::inc(&inner.metrics.cache_misses_total);
    Ok(with_cache_status(response, &config.proxy_id, &detail))
}

/// Adds this proxy's `Cache-Status` entry (RFC 9211).
fn with_cache_status(mut response: Response<Body>, id: &str, detail: &str) -> Response<Body> {
    if let Ok(v) = HeaderValue::from_str(&format!("\"{id}\"; {detail}")) {
        response
            .headers_mut()
            .append(HeaderName::from_static("cache-status"), v);
    }
    response
}

/// Reads a storable 200 whole (its length is declared and within
/// `--max-body-bytes`), stores it, and answers from the stored state,
/// so the answer carries the version derived from the body.
async fn fetch_whole(
    inner: Arc<Inner>,
    response: Response<Body>,
    probe: Request<()>,
    target: Arc<Resource>,
    sent: (Timing, Ticket),
    fwd: &'static str,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
) -> Result<Response<Body>, Refusal> {
    use http_body_util::BodyExt;
    let (parts, body) = response.into_parts();
    let limit = inner.config.max_body_bytes;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    let read = async move {
        use bytes::Buf;
        let mut body = body;
        let mut buf = bytes::BytesMut::with_capacity(declared.unwrap_or(0).min(limit));
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("origin body failed: {e}"))?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.remaining() > limit {
                    return Err("origin body is larger than its Content-Length".to_string());
                }
                buf.extend_from_slice(data.chunk());
            }
        }
        Ok::<_, String>(body::compact(buf))
    };
    let bytes = match tokio::time::timeout(inner.config.response_timeout, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(reason)) => return Err(Refusal::UpstreamBroken(reason)),
        Err(_) => return Err(Refusal::UpstreamTimeout(inner.config.response_timeout)),
    };
    inner
        .watchers
        .absorb_fetched(&target, parts.status, &parts.headers, bytes, sent, true);
    target.validated(true);
    drop(guard);
    let stored = target
        .stored()
        .ok_or_else(|| Refusal::UpstreamBroken("origin answer could not be stored".into()))?;
    let head = target.head();
    Ok(subscribe::serve_stored(
        &probe,
        &stored,
        &head,
        CacheOutcome::Fetched { fwd },
        &inner.config.proxy_id,
    ))
}

/// The answer to `only-if-cached` when nothing stored will do (RFC 9111 §5.2.1.7).
fn only_if_cached_miss() -> Response<Body> {
    let mut response = Response::new(body::full(
        "nothing stored for this request (only-if-cached)\n",
    ));
    *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
    response
}

/// The path and query of a `Location` or `Content-Location` value that
/// names this origin: relative, or absolute with the request's host.
fn same_origin_target(value: &HeaderValue, host: Option<&str>) -> Option<String> {
    let text = value.to_str().ok()?;
    let uri: http::Uri = text.parse().ok()?;
    if let Some(authority) = uri.authority() {
        if Some(authority.as_str()) != host {
            return None;
        }
    } else if !text.starts_with('/') {
        return None;
    }
    uri.path_and_query().map(|p| p.as_str().to_string())
}

/// The registry key of a request: its path and query.
fn key_of<B>(req: &Request<B>) -> String {
    req.uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string()
}
