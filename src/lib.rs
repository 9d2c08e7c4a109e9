//! braid-proxy: a reverse proxy that serves a plain REST origin's resources
//! as Braid-HTTP subscriptions.
//!
//! The layout follows one resource model with two feeds (DESIGN.md). The
//! layers, top to bottom: a module imports only modules on lines below its
//! own, never one on its own line or above (tests/layers.rs reads this list
//! and checks every `crate::` path outside tests against it):
//!
//! 1. `listen`
//! 2. `admin`
//! 3. `router`
//! 4. `cache`, `writes`, `status`, `purges`
//! 5. `serve`
//! 6. `feed`
//! 7. `state`
//! 8. `deliver`
//! 9. `upstream`
//! 10. `tls`
//! 11. `diff`, `limits`
//! 12. `braid`
//! 13. `error`
//! 14. `floor`
//! 15. `config`, `metrics`, `logtime`, `demo`
//!
//! - [`listen`]: listeners and connections (HTTP/1.1 + h2c), the HTTP/1.1
//!   subscription fast path, h2c write coalescing; calls the router.
//! - [`admin`], [`status`]: metrics, health, refresh, purge, the operator's page.
//! - [`router`]: classifies each request once and makes one call; access log.
//! - [`cache`]: the GET path answered from state by RFC 9111, ranges, purge.
//! - [`writes`]: Braid patch writes applied onto plain origins under `If-Match`.
//! - [`purges`]: the purge feed (spec/tiers.md): the purges and refreshes
//!   this proxy performed, served as a Braid subscription to the tiers
//!   below, and the upstream's feed followed. What it follows is applied
//!   by a function the router hands it, so it never imports the router.
//! - [`serve`]: a subscription's 209 and answers made from state; the multiplexer.
//! - [`feed`]: how a resource learns its changes: [`feed::poll`] (a plain
//!   origin) or [`feed::braid`] (an upstream Braid subscription, relayed).
//! - [`state`]: the resource model: [`state::Resource`] (current state,
//!   window of updates, ordering tickets), its [`state::Key`], and the
//!   [`state::Registry`] (caps, eviction).
//! - [`deliver`]: what a subscriber follows ([`deliver::window::Window`],
//!   implemented by each feed) and how it reaches its socket (a cursor on
//!   its own task, or direct delivery to parked sockets).
//! - [`upstream`]: the one client to the configured upstream, with its
//!   pass-through rules and health.
//! - [`tls`]: TLS on the listener (certificate, client certificates,
//!   reload) and to an https upstream (verification, SNI, ALPN).
//! - The ground floor, which imports nothing above it: [`floor`] (bodies,
//!   header helpers, chunk framing, RFC 9111's rules as pure functions, the
//!   lock helper), [`braid`] (the wire protocol: request headers, update
//!   encoding, decoding and framing, patches), [`error`] (refusals),
//!   [`diff`] (old body + new body → patches), [`limits`] (open files),
//!   [`config`], [`metrics`], [`logtime`] and [`demo`] (the embedded demo
//!   origin).

// No unwrap() on anything that comes from the network: checked by clippy outside tests.
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod admin;
pub mod braid;
pub mod cache;
pub mod config;
pub mod deliver;
pub mod demo;
pub mod diff;
pub mod error;
pub mod feed;
pub mod floor;
pub mod limits;
pub mod listen;
pub mod logtime;
pub mod metrics;
pub mod purges;
pub mod router;
pub mod serve;
pub mod state;
pub mod status;
pub mod tls;
pub mod upstream;
pub mod writes;
