//! A running proxy in a chain of tiers (tests/chaining.rs,
//! tests/purge_tree.rs): the crate's `Server` on 127.0.0.1:0 with an admin
//! listener, stopped on demand.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use braid_proxy::config::{Config, Upstream};
use braid_proxy::listen::server::Server;
use tokio::sync::oneshot;

/// Bound of a tier's shutdown and of every metric wait.
const WAIT: Duration = Duration::from_secs(10);

/// A tier named `id` in front of `upstream`, listening on `listen`, with
/// an admin listener, polling every 100 ms and sending no heartbeats.
pub fn config(id: &str, upstream: SocketAddr, listen: SocketAddr) -> Config {
    Config {
        listen,
        admin_listen: Some("127.0.0.1:0".parse().expect("addr")),
        upstream: Some(Upstream::parse(&format!("http://{upstream}")).expect("upstream")),
        poll_interval: Duration::from_millis(100),
        heartbeat: Duration::ZERO,
        proxy_id: id.to_string(),
        shutdown_grace: Duration::from_millis(200),
        ..Config::default()
    }
}

/// A running proxy; [`Tier::kill`] (or dropping it) shuts it down.
pub struct Tier {
    /// Its `--proxy-id`.
    pub id: String,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
}

impl Tier {
    pub async fn start(config: Config) -> Tier {
        let id = config.proxy_id.clone();
        let server = Server::bind(config).await.expect("bind proxy");
        let addr = server.local_addr().expect("addr");
        let admin = server.admin_addr().expect("admin addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let done = tokio::spawn(async move {
            server
                .run(async {
                    let _ = stopped.await;
                })
                .await
                .expect("proxy runs");
        });
        Tier {
            id,
            addr,
            admin,
            stop: Some(stop),
            done,
        }
    }

    /// Shuts the proxy down and waits until it has.
    pub async fn kill(mut self) {
        drop(self.stop.take());
        tokio::time::timeout(WAIT, &mut self.done)
            .await
            .expect("proxy stops in time")
            .expect("proxy task");
    }

    /// One metric's value from the admin listener.
    pub async fn metric(&self, name: &str) -> f64 {
        super::wire::metric(self.admin, name).await
    }

    /// Waits (bounded) until a metric satisfies `ok`.
    pub async fn wait_metric(&self, name: &str, ok: impl Fn(f64) -> bool, what: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let got = self.metric(name).await;
            if ok(got) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{}: {what}: {name} is {got}",
                self.id
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until this tier follows its upstream's purge feed
    /// (src/purges.rs), which it asks for once an answer from its
    /// upstream named it.
    pub async fn wait_following(&self) {
        self.wait_metric("purge_feed_following", |v| v == 1.0, "follows the feed")
            .await;
    }
}
