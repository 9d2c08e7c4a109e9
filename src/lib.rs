//! braid-proxy: a reverse proxy that serves a plain REST origin's resources
//! as Braid-HTTP subscriptions.
//!
//! The layout follows one resource model with two feeds (DESIGN.md);
//! dependencies point one way: `net → router → {cache, serve, writes} →
//! state ← feed`, with [`braid`] below everything.
//!
//! - [`net`]: listeners and connections (HTTP/1.1 + h2c), the subscription
//!   fast path, write coalescing, bodies, and the one upstream client.
//! - [`router`]: classifies each request once and makes one call; access log.
//! - [`state`]: the resource model: [`state::Resource`] (current state,
//!   window of updates, ordering tickets) and the [`state::Registry`] (keys,
//!   caps, eviction).
//! - [`feed`]: how a resource learns its changes: [`feed::poll`] (a plain
//!   origin) or [`feed::braid`] (an upstream Braid subscription).
//! - [`cache`]: RFC 9111 as pure functions.
//! - [`serve`]: subscribers: the 209 and its cursor, direct delivery,
//!   the multiplexer.
//! - [`writes`]: Braid patch writes applied onto plain origins under `If-Match`.
//! - [`braid`]: the wire protocol: headers, update encoding and decoding, patches.
//! - [`diff`]: old body + new body → patches.
//! - [`admin`], [`status`]: metrics, health, refresh, the operator's page.
//! - [`config`], [`error`], [`metrics`], [`demo`], [`logtime`]: flags and TOML, refusals,
//!   counters, the embedded demo origin, the log lines' timestamp.
//! - [`tls`]: TLS on the listener (certificate, client
//!   certificates, reload) and to an https upstream (verification, ALPN).
//! - [`limits`]: open files: the descriptor limit raised at start, and the
//!   reserve kept by refusing subscriptions before it runs out.

// No unwrap() on anything that comes from the network: checked by clippy outside tests.
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod admin;
pub mod braid;
pub mod cache;
pub mod config;
pub mod demo;
pub mod diff;
pub mod error;
pub mod feed;
pub mod limits;
pub mod logtime;
pub mod metrics;
pub mod net;
pub mod router;
pub mod serve;
pub mod state;
pub mod status;
pub mod tls;
pub mod writes;
