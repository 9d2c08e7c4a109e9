//! braid-proxy: a reverse proxy that serves a plain REST origin's resources
//! as Braid-HTTP subscriptions.
//!
//! The layout follows the path of one update:
//!
//! - [`config`]: flags and TOML into one validated [`config::Config`].
//! - [`server`]: listeners, connections, HTTP/1.1 + h2c, graceful shutdown.
//! - [`coalesce`]: an h2c connection's frames of one update in one write.
//! - [`fastpath`]: HTTP/1.1 subscriptions written to the socket without hyper.
//! - [`direct`]: one pass per change writes it to every caught-up fast-path subscriber.
//! - [`router`]: the request pipeline: filter, Braid side or pass-through, access log.
//! - [`proxy`]: pass-through proxying to the one configured upstream.
//! - [`relay`]: a Braid upstream's subscriptions relayed byte for byte and fanned out.
//! - [`upstream`]: watchers that poll a plain origin.
//! - [`braid`]: the wire protocol: headers, update encoding and decoding, patches.
//! - [`diff`]: old body + new body → patches.
//! - [`multiplex`]: braid-http's multiplexing: many responses in one stream.
//! - [`writes`]: Braid patch writes applied onto plain origins under `If-Match`.
//! - [`admin`]: metrics, health, the refresh hook, and the operator's page.
//! - [`status`]: what the operator's page shows, read from the live structures.
//! - [`demo`]: the embedded demo origin.
//! - [`error`]: every refusal mapped to a status and a one-line reason.
//! - [`body`], [`metrics`]: the body type and the counters.

// No unwrap() on anything that comes from the network: checked by clippy outside tests.
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod admin;
pub mod body;
pub mod braid;
pub mod cache;
pub mod coalesce;
pub mod config;
pub mod demo;
pub mod diff;
pub mod direct;
pub mod error;
pub mod fastpath;
pub mod metrics;
pub mod multiplex;
pub mod proxy;
pub mod relay;
pub mod resource;
pub mod router;
pub mod server;
pub mod status;
pub mod subscribe;
pub mod upstream;
pub mod writes;
