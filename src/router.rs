//! The request pipeline: filter, route to the Braid side or pass through,
//! and log one access line per request.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use tokio::sync::watch;
use tracing::info;

use crate::braid::BraidRequest;
use crate::cache::get::Gets;
use crate::config::{Config, MultiplexMode, UpstreamKind};
use crate::error::Refusal;
use crate::feed::braid::{Relayed, Relays};
use crate::feed::poll::{self, Watchers};
use crate::floor::body::{self, Body, BoxError, RequestBody};
use crate::floor::phase::CachePhase;
use crate::limits::OpenFiles;
use crate::metrics::Metrics;
use crate::purges::{self, Purge, Purges};
use crate::serve::multiplex::{self, Multiplexers};
use crate::serve::subscribe::{Cors, Subscriptions};
use crate::state::{History, Key, Kind, Registry, RegistryLimits, Resource, Tuning};
use crate::upstream::{self, ConnInfo, UpstreamClient};
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
    /// The GET path from state.
    gets: Arc<Gets>,
    /// Descriptors open against the limit; new subscriptions are refused
    /// within its reserve.
    open_files: Arc<OpenFiles>,
    /// The purges this proxy performed, served to the tiers below it.
    purges: Arc<Purges>,
}

/// What a request is: the closed set of routes [`Router::classify`]
/// decides between, once per request.
enum Route {
    /// This proxy's purge feed, for the tiers below (src/purges.rs).
    PurgeFeed,
    /// A CORS preflight, answered here.
    Preflight(Response<Body>),
    /// For the upstream as it is: requests for the upstream's own
    /// multiplexer (`--multiplex relay`), a GET or HEAD with a body, a
    /// per-peer stream, `OPTIONS` and `TRACE`.
    PassThrough,
    /// For this proxy's multiplexer, or answered through it.
    Multiplexer(multiplex::Intent),
    /// A subscription (`GET` with `Subscribe`).
    Subscribe(BraidRequest),
    /// A `GET` or `HEAD`, answered by the cache.
    Get(BraidRequest),
    /// A Braid patch write.
    PatchWrite(BraidRequest),
    /// Any other unsafe method: written through, invalidating what it names.
    Unsafe,
}

impl Router {
    /// Builds the shared state; the configuration must name an upstream.
    pub fn new(mut config: Config) -> Result<Router, BoxError> {
        if config.proxy_id.is_empty() {
            config.proxy_id = crate::config::default_proxy_id(config.listen.port());
        }
        let upstream = config.upstream.clone().ok_or("no upstream configured")?;
        let metrics = Arc::new(Metrics::default());
        let client = UpstreamClient::new(upstream, &config, metrics.clone())?;
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
            poll_max_interval: config.poll_ceiling(),
            budget: crate::feed::pace::Budget::new(config.origin_rps),
            resource_idle: config.resource_idle,
            max_body_bytes: config.max_body_bytes,
            response_timeout: config.response_timeout,
            max_header_bytes: config.max_header_bytes,
            closing: closing_rx.clone(),
            reading: Arc::default(),
        });
        let relays = Arc::new(Relays::new(
            client.clone(),
            config.clone(),
            metrics.clone(),
            registry.clone(),
            closing_rx.clone(),
        ));
        let purges = Arc::new(Purges::new(
            client.clone(),
            config.clone(),
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
        let reading = watchers.reading.clone();
        registry.count_also(move || reading.load(std::sync::atomic::Ordering::Relaxed));
        let multiplexers = Multiplexers::new(multiplex::Limits {
            max_multiplexers: config.max_multiplexers,
            max_requests: config.max_multiplexed_requests,
            idle: config.multiplexer_idle,
            ..multiplex::Limits::default()
        });
        let gets = Arc::new(Gets {
            config: config.clone(),
            client: client.clone(),
            metrics: metrics.clone(),
            registry: registry.clone(),
            watchers: watchers.clone(),
            relays: relays.clone(),
            copies,
            first: Default::default(),
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
            gets,
            open_files: Arc::new(OpenFiles::for_this_process()),
            purges,
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

    /// The descriptor budget: the accept loop counts client connections in it.
    pub fn open_files(&self) -> &Arc<OpenFiles> {
        &self.inner.open_files
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
            open_files: &inner.open_files,
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
        let files = &self.inner.open_files;
        let as_gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        metrics.open_fds.store(
            as_gauge(files.count()),
            std::sync::atomic::Ordering::Relaxed,
        );
        metrics.max_fds.store(
            as_gauge(files.limit()),
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
        let intervals = crate::metrics::Histogram::new(crate::metrics::AGE_BUCKETS);
        for resource in self.inner.registry.all() {
            if resource.subscribers() == 0 {
                continue;
            }
            if let Some(every) = resource.poll_interval() {
                intervals.observe(every.as_secs_f64());
            }
            let v = resource.validation();
            let age = v
                .answered_at
                .map_or(f64::INFINITY, |at| at.elapsed().as_secs_f64());
            ages.observe(age);
        }
        ages.render(
            &mut out,
            "validation_age_seconds",
            "Per subscribed resource: seconds since its upstream last answered a revalidation (0 while a Braid upstream stream is live).",
        );
        intervals.render(
            &mut out,
            "poll_interval_seconds",
            "Per polled subscribed resource: its watcher's interval now (--poll-interval after a change, doubling while quiet up to --poll-max-interval).",
        );
        let budget = &self.inner.watchers.budget;
        let delayed = budget.delayed();
        let _ = writeln!(
            out,
            "# HELP braid_proxy_polls_delayed_total Watcher requests that waited for a slot of --origin-rps or for an origin's Retry-After.\n# TYPE braid_proxy_polls_delayed_total counter\nbraid_proxy_polls_delayed_total {delayed}\n# HELP braid_proxy_origin_paused_seconds Seconds left of the pause an origin's Retry-After asked of every watcher.\n# TYPE braid_proxy_origin_paused_seconds gauge\nbraid_proxy_origin_paused_seconds {}",
            budget.paused_for().map_or(0.0, |d| d.as_secs_f64())
        );
        // The process as a whole, under the names Prometheus's own clients
        // use, and what build this is.
        if let Some(rss) = resident_bytes() {
            let _ = writeln!(
                out,
                "# HELP process_resident_memory_bytes Resident memory of the proxy's process (VmRSS).\n# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes {rss}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP process_open_fds Descriptors the process has open.\n# TYPE process_open_fds gauge\nprocess_open_fds {}\n# HELP process_max_fds The process's descriptor limit.\n# TYPE process_max_fds gauge\nprocess_max_fds {}",
            files.count(),
            files.limit()
        );
        let _ = writeln!(
            out,
            "# HELP braid_proxy_build_info The running build: its version.\n# TYPE braid_proxy_build_info gauge\nbraid_proxy_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        self.inner.purges.render_metrics(&mut out);
        out
    }

    /// Whether this proxy can serve: `Err` with the reason when the
    /// upstream's latest answer was a failure, or when a subscribed
    /// resource has not heard from its upstream for three poll intervals
    /// ([`Resource::unheard`]: its watcher is wedged, or the upstream
    /// fails). An answer about one client (a 401 to its credentials, a
    /// 404) is the upstream answering, never a reason.
    pub fn readiness(&self) -> Result<(), String> {
        if let Some(reason) = self.inner.client.health.down() {
            // Every recorded failure says what failed (UpstreamHealth::failed).
            return Err(reason);
        }
        let limit = crate::state::unheard_limit(self.inner.config.poll_ceiling());
        let stuck = self
            .inner
            .registry
            .all()
            .into_iter()
            .filter(|r| r.unheard(limit))
            .count();
        if stuck > 0 {
            return Err(format!(
                "{stuck} subscribed resource(s) without an answer from the upstream for {limit:?}"
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

    /// Invalidates every tracked variant of a URL after a write: stored
    /// answers are revalidated before reuse, and watchers revalidate now.
    /// False when the URL is not tracked.
    pub fn revalidate(&self, path_and_query: &str) -> bool {
        let variants = self.inner.registry.variants(path_and_query);
        for resource in &variants {
            resource.invalidate();
            resource.refresh();
        }
        !variants.is_empty()
    }

    /// The refresh hook (`POST /refresh?path=`): every tracked variant of
    /// the URL is fetched anew, unconditionally (an origin whose validator
    /// stays while its body changes is still heard): stored answers are
    /// dropped, so the next GET asks the origin for the whole body, and
    /// each watcher fetches now, its subscribers hearing what it gets.
    /// False when the URL is not tracked.
    pub fn refresh(&self, path_and_query: &str) -> bool {
        let variants = self.inner.registry.variants(path_and_query);
        for resource in &variants {
            resource.set_stored(None);
            resource.refetch();
        }
        !variants.is_empty()
    }

    /// Purges the stored answers `selector` names (admin `POST /purge`):
    /// how many variants were purged.
    pub fn purge(&self, selector: crate::cache::purge::Selector<'_>) -> usize {
        let purged = crate::cache::purge::purge(&self.inner.registry, selector);
        self.inner
            .metrics
            .cache_purged_total
            .fetch_add(purged as u64, std::sync::atomic::Ordering::Relaxed);
        purged
    }

    /// An operator's purge or refresh, or one from the upstream's purge
    /// feed: applied here, then published on this proxy's own feed for
    /// the tiers below (src/purges.rs). How many variants it reached.
    pub fn apply_purge(&self, purge: &Purge) -> usize {
        use crate::cache::purge::Selector;
        let reached = match purge {
            Purge::Path(path) => self.purge(Selector::Path(path)),
            Purge::Tag(tag) => self.purge(Selector::Tag(tag)),
            Purge::All => self.purge(Selector::All),
            Purge::Refresh(path) => usize::from(self.refresh(path)),
        };
        self.inner.purges.publish(purge);
        reached
    }

    /// Follows the upstream's purge feed until the proxy shuts down,
    /// applying what it carries as [`Router::apply_purge`] does.
    pub fn follow_purges(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let router = self.clone();
        let seen = self.inner.client.announces_purge_feed.subscribe();
        self.inner.purges.clone().follow(seen, move |purge| {
            router.apply_purge(purge);
        })
    }

    /// Handles one client request; never fails, errors become responses.
    pub async fn handle(&self, mut req: Request<RequestBody>, conn: ConnInfo) -> Response<Body> {
        let started = Instant::now();
        Metrics::inc(&self.inner.metrics.requests_total);
        req.extensions_mut().insert(conn);
        let method = req.method().clone();
        // A clone shares the request line's bytes: no copy for the log line.
        let uri = req.uri().clone();
        let version = req.version();
        let cors_request = self.inner.cors.enabled().then(|| req.headers().clone());
        let to_a_tier = crate::cache::get::from_a_tier_below(&req);
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
        if to_a_tier {
            // A tier below learns here that this proxy serves a purge feed.
            response.headers_mut().insert(
                crate::floor::headers::PURGE_FEED,
                HeaderValue::from_static(purges::FEED_PATH),
            );
        }
        let target = uri.path_and_query().map_or("", |p| p.as_str());
        let cache = response
            .extensions()
            .get::<CachePhase>()
            .map_or("-", CachePhase::name);
        let elapsed = started.elapsed();
        let (status, took) = (response.status().as_u16(), Tenths(elapsed));
        if self.inner.config.log_format == crate::config::LogFormat::Json {
            // Each part its own field, for whatever reads the JSON; the
            // message as the text line has it.
            info!(
                target: "access",
                method = %method,
                path = target,
                version = ?version,
                status,
                duration_ms = (elapsed.as_secs_f64() * 10_000.0).round() / 10.0,
                peer = %Peer(conn.peer),
                cache = %cache,
                "{method} {target} {version:?} {status} {took}ms"
            );
        } else {
            info!(
                target: "access",
                peer = %Peer(conn.peer),
                cache = %cache,
                "{method} {target} {version:?} {status} {took}ms"
            );
        }
        response
    }

    fn name_in_via(&self, response: &mut Response<Body>) {
        let proxy_id = &self.inner.config.proxy_id;
        if !upstream::via_names(response.headers(), proxy_id) {
            upstream::append_via(response.headers_mut(), http::Version::HTTP_11, proxy_id);
        }
    }

    /// Classifies a request once, then makes the one call its route names.
    async fn route(&self, req: Request<RequestBody>) -> Result<Response<Body>, Refusal> {
        match self.classify(&req)? {
            Route::PurgeFeed => Ok(self.inner.purges.serve(&req)),
            Route::Preflight(answer) => Ok(answer),
            Route::PassThrough => self.pass_through(req).await,
            Route::Multiplexer(intent) => self.multiplexed(req, intent).await,
            Route::Subscribe(braid) => self.subscribe(req, braid).await,
            Route::Get(braid) => self.inner.gets.get(req, braid).await,
            Route::PatchWrite(braid) => self.patch_write(req, braid).await,
            Route::Unsafe => self.unsafe_method(req).await,
        }
    }

    /// What a request is, from its method, target and headers (never its
    /// body): the one place a request's kind is decided.
    fn classify(&self, req: &Request<RequestBody>) -> Result<Route, Refusal> {
        let inner = &self.inner;
        let config = &inner.config;
        upstream::request_filter(req, config)?;
        if req.uri().path() == purges::FEED_PATH {
            // This proxy's own resource, never the origin's.
            return Ok(Route::PurgeFeed);
        }
        if let Some(preflight) = inner.cors.preflight(req) {
            return Ok(Route::Preflight(preflight));
        }
        if config.multiplex == MultiplexMode::Relay && multiplex::is_multiplexing(req) {
            // The upstream's own multiplexer serves these (spec/multiplex.md).
            return Ok(Route::PassThrough);
        }
        if let Some(intent) = multiplex::classify(req, inner.multiplexers.limits())? {
            return Ok(Route::Multiplexer(intent));
        }
        let braid = BraidRequest::parse(req.headers())?;
        let method = req.method();
        if matches!(*method, Method::GET | Method::HEAD) && upstream::needs_own_connection(req) {
            // A body on a GET: its answer may depend on it, so it is
            // neither stored nor shared; it goes up on its own connection.
            if braid.subscribe {
                return Err(Refusal::BadRequest(
                    "a subscription request must not carry a body".into(),
                ));
            }
            return Ok(Route::PassThrough);
        }
        Ok(match *method {
            Method::GET | Method::HEAD if braid.peer_specific => Route::PassThrough,
            Method::GET if braid.subscribe => Route::Subscribe(braid),
            Method::GET | Method::HEAD => Route::Get(braid),
            Method::OPTIONS | Method::TRACE => Route::PassThrough,
            _ if writes::carries_patches(req) => Route::PatchWrite(braid),
            _ => Route::Unsafe,
        })
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
        self.inner.gets.request_key(req)
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
        if self.inner.gets.kind_of(&key) == Kind::Braid {
            return self.unsafe_method(req).await;
        }
        let (resource, _, ()) = inner.registry.get_or_create(
            &key,
            || upstream::watcher_template(&req, &inner.config),
            |_| (),
        )?;
        if inner.config.upstream_kind == UpstreamKind::Auto && resource.kind() == Kind::Unknown {
            // An upstream that said on every answer from this directory
            // that it takes range writes by PUT (a braidify server) applies
            // them itself: the write is its own (spec/writes.md §1).
            if inner.client.declares.declared_for(&path) {
                return self.unsafe_method(req).await;
            }
            // Else learn what this resource's upstream is (one GET) before
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
        upstream::pass_through(req, &self.inner.client, &self.inner.config).await
    }

    /// Asks the upstream for `resource` once (a GET with its template
    /// headers) to learn whether it speaks Braid; the body is not read.
    async fn learn_kind(&self, resource: &Resource) -> Kind {
        let inner = &self.inner;
        let Ok(req) = inner.watchers.plain_get(resource, None) else {
            return Kind::Unknown;
        };
        match inner.client.send_watch(req).await {
            Ok(response) if crate::feed::braid::braid_signs(response.headers()) => {
                resource.learn_kind(Kind::Braid);
                inner.registry.learn_braid(resource.key());
            }
            Ok(response) if response.status() == StatusCode::OK => {
                inner.registry.learn_plain(resource)
            }
            _ => {}
        }
        resource.kind()
    }

    /// An unsafe (or unknown) method: forwarded; a non-error answer
    /// invalidates the URL, and the same-origin `Location` and
    /// `Content-Location` it names (RFC 9111 §4.4), and revalidates their
    /// watchers at once (write-through).
    async fn unsafe_method(&self, req: Request<RequestBody>) -> Result<Response<Body>, Refusal> {
        let path = crate::state::path_of(&req);
        let host = upstream::client_host(&req);
        let response = self.pass_through(req).await?;
        let status = response.status();
        if status.is_success() || status.is_redirection() {
            self.inner.relays.written(&path);
            // Answers to requests sent before the write landed may show
            // the document before it: not recorded (Resource::record).
            for variant in self.inner.registry.variants(&path) {
                variant.landed();
            }
            self.revalidate(&path);
            for name in [header::LOCATION, header::CONTENT_LOCATION] {
                if let Some(target) = response
                    .headers()
                    .get(name)
                    .and_then(|v| same_origin_target(v, host.as_deref()))
                {
                    self.revalidate(&target);
                }
            }
        }
        Ok(response)
    }

    /// The 503 a new subscription gets within the open-files reserve,
    /// which keeps the last descriptors for the admin listener, upstream
    /// connections and plain GETs. Over HTTP/1.1 it closes the connection:
    /// a client keeping a refused connection open would hold one of them.
    fn refuse_within_file_reserve(&self, version: http::Version) -> Option<Response<Body>> {
        let (files, metrics) = (&self.inner.open_files, &self.inner.metrics);
        if files.admits_subscription() {
            return None;
        }
        Metrics::inc(&metrics.subscriptions_rejected_total);
        let mut response = Refusal::Unavailable {
            reason: format!(
                "too few open files left for a new subscription ({} of {} in use); retry later",
                files.estimate(),
                files.limit()
            ),
            retry_after: Duration::from_secs(5),
        }
        .into_response();
        if version <= http::Version::HTTP_11 {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        Some(response)
    }

    async fn subscribe(
        &self,
        mut req: Request<RequestBody>,
        braid: BraidRequest,
    ) -> Result<Response<Body>, Refusal> {
        let inner = &self.inner;
        // Before anything is opened for it (an upstream request, state).
        if let Some(refused) = self.refuse_within_file_reserve(req.version()) {
            return Ok(refused);
        }
        crate::braid::speak_upstream(&mut req, &braid);
        let headers = req.headers().clone();
        let (key, host) = self.request_key(&req);
        let path = key.path.clone();
        // A Braid upstream (or one not known yet) gets the client's own
        // request; a plain origin's first answer seeds the polled resource.
        // `Poll`: an equivalent request's answer just showed a plain
        // origin; that request seeds the resource, this one waits for it.
        let kind = self.inner.gets.kind_of(&key);
        let (template, mut seed) = if kind != Kind::Plain {
            match inner
                .relays
                .subscribe(req, &braid, kind == Kind::Braid)
                .await?
            {
                Relayed::Answer(mut response) => {
                    crate::braid::answer_in_own_dialect(&mut response, &braid);
                    return Ok(response);
                }
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
            (upstream::watcher_template(&req, &inner.config), None)
        };
        let limit = inner.config.response_timeout + inner.config.connect_timeout;
        // A state about to be made reserves what it will hold before its
        // body is read (admission checks reservations, so a burst cannot
        // outrun the count), and gives the rest back once counted.
        let mut reservation = match &seed {
            Some((response, ..)) => Some(inner.registry.reserve(first_state_bytes(
                response.headers(),
                inner.config.max_body_bytes,
            ))?),
            None if !inner
                .registry
                .is_tracked(&inner.registry.key_for(&path, &headers, &host)) =>
            {
                Some(inner.registry.reserve(first_state_bytes(
                    &http::HeaderMap::new(),
                    inner.config.max_body_bytes,
                ))?)
            }
            None => None,
        };
        // Twice at most: the first answer may name a `Vary` under which
        // this request is another variant than the resource it waited on.
        let mut attempts = 0;
        // Before a watcher this request starts: its first poll counts as
        // the revalidation this subscription waits for.
        let mut arrived;
        let (resource, rx, created, seeded_here, started) = loop {
            attempts += 1;
            arrived = std::time::SystemTime::now();
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
                    inner.registry.learn_plain(&resource);
                }
                inner
                    .watchers
                    .seed(&resource, response, timing, ticket)
                    .await;
                drop(seeding);
                counted_in_full(&resource, reservation.take());
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
            }
            // A seed that gave no state (a coded body, say) is followed by
            // the watcher's own poll at once; a refused one is final.
            if resource.head().seq == 0 && resource.refusal().is_none() {
                if seeded {
                    resource.wake.notify_one();
                }
                poll::await_validation(&resource, generation, limit).await;
            }
            // Another request's answer showed it is not to be shared (one
            // client's, or another variant than its key said): this
            // request gets a resource of its own, asked with its own
            // headers (a cache's hit-for-miss).
            if resource.is_detached() && !created && !seeded && attempts < 3 {
                drop(rx);
                continue;
            }
            // Another request's answer seeded it: is it this request's variant?
            let rekeyed = inner.registry.key_for(&path, &headers, &host) != key;
            if seeded || claimed || !rekeyed || attempts >= 2 {
                break (resource, rx, created, seeded, claimed);
            }
        };
        counted_in_full(&resource, reservation.take());
        if created {
            // Its first state may have put the proxy over --state-bytes.
            inner.registry.refuse_if_full(&resource)?;
        }
        if !seeded_here && resource.head().seq > 0 {
            // Never name a stale version current: an idle resource's state
            // is an old answer, and a client whose version is unknown here
            // may have seen newer elsewhere (another shield).
            let parents_unknown = braid
                .parents
                .as_ref()
                .is_some_and(|p| !p.is_empty() && resource.seq_of(p).is_none());
            let current = inner
                .watchers
                .revalidate_for(&resource, (arrived, parents_unknown), !started, limit)
                .await;
            if !current && parents_unknown {
                return Err(Refusal::Unavailable {
                    reason: "the origin did not answer a revalidation in time; this proxy's version may be older than the one the client has".into(),
                    retry_after: Duration::from_secs(1),
                });
            }
        }
        if let Some(denied) = crate::serve::subscribe::denial(&resource.head()) {
            // The origin refused this request's credentials: its answer, not a 209.
            return Ok(denied);
        }
        if resource.head().seq == 0 {
            return Err(resource.refusal().unwrap_or_else(|| Refusal::UpstreamBroken(
                "no state for this resource yet: the origin could not be reached or gave an unusable answer".into(),
            )));
        }
        inner.subscriptions.respond(resource, rx, &braid)
    }
}

/// Ends `reservation` (if any) once `resource`'s first state is counted in
/// full: its snapshot, which a new subscriber needs first, is built now,
/// while the reservation still counts for it.
fn counted_in_full(resource: &Resource, reservation: Option<crate::state::Reservation>) {
    let Some(reservation) = reservation else {
        return;
    };
    let head = resource.head();
    if head.seq > 0 {
        // Built once per head, and counted from then on (Head::snapshot).
        head.snapshot();
    }
    drop(reservation);
}

/// What a resource's first state is expected to hold, reserved before it
/// is read: its body and the snapshot frame built from it, with the
/// resource's own cost; a body of unknown length is taken as
/// [`UNKNOWN_BODY_BYTES`] (it is counted as read, and the proxy refuses
/// more once over the cap), one over `--max-body-bytes` as none (it is
/// not read).
fn first_state_bytes(headers: &http::HeaderMap, max_body_bytes: usize) -> usize {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok());
    let body = match declared {
        Some(n) if n > max_body_bytes => 0,
        Some(n) => n,
        None => UNKNOWN_BODY_BYTES.min(max_body_bytes),
    };
    2 * body + 2 * crate::state::header_bytes(headers) + 4096
}

/// The body length reserved for a first state whose length is not declared.
const UNKNOWN_BODY_BYTES: usize = 256 * 1024;

/// The process's resident memory in bytes (`VmRSS` of /proc/self/status),
/// where the system tells it.
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A client's address as `SocketAddr` displays it; an IPv4 one written
/// in one piece, without the formatter's padding logic (it runs for every
/// access-log line).
struct Peer(std::net::SocketAddr);

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let std::net::SocketAddr::V4(v4) = self.0 else {
            return self.0.fmt(f);
        };
        // "255.255.255.255:65535" and the separator pushed after the port.
        let mut out = [0u8; 22];
        let mut len = 0;
        let mut push = |n: u32, sep: u8| {
            let mut digits = [0u8; 5];
            let mut i = digits.len();
            let mut n = n;
            loop {
                i -= 1;
                digits[i] = b'0' + (n % 10) as u8;
                n /= 10;
                if n == 0 {
                    break;
                }
            }
            for &b in &digits[i..] {
                out[len] = b;
                len += 1;
            }
            out[len] = sep;
            len += 1;
        };
        let [a, b, c, d] = v4.ip().octets();
        push(u32::from(a), b'.');
        push(u32::from(b), b'.');
        push(u32::from(c), b'.');
        push(u32::from(d), b':');
        push(u32::from(v4.port()), b' ');
        // Only ASCII digits, dots and a colon were written.
        f.write_str(std::str::from_utf8(&out[..len - 1]).unwrap_or(""))
    }
}

/// Milliseconds with one decimal, as `{:.1}` writes them, without
/// floating point.
struct Tenths(Duration);

impl std::fmt::Display for Tenths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tenths = (self.0.as_nanos() + 50_000) / 100_000;
        write!(f, "{}.{}", tenths / 10, tenths % 10)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_as_socket_addr_displays() {
        for addr in [
            "0.0.0.0:0",
            "127.0.0.1:52080",
            "255.255.255.255:65535",
            "10.0.20.3:8",
            "[::1]:443",
            "[2001:db8::7]:80",
        ] {
            let addr: std::net::SocketAddr = addr.parse().unwrap();
            assert_eq!(Peer(addr).to_string(), addr.to_string());
        }
    }

    #[test]
    fn tenths_as_one_decimal() {
        for nanos in [
            0,
            49_999,
            50_000,
            149_999,
            1_000_000,
            12_345_678,
            999_950_000,
        ] {
            let d = Duration::from_nanos(nanos);
            let float = format!("{:.1}", d.as_secs_f64() * 1000.0);
            assert_eq!(Tenths(d).to_string(), float, "{nanos}");
        }
    }
}
