//! The network side: listeners and connections ([`server`]), the HTTP/1.1
//! subscription fast path ([`fastpath`]), h2c write coalescing
//! ([`coalesce`]), the body type ([`body`]), and the one client to the
//! configured upstream with its pass-through rules ([`proxy`]).

pub mod body;
pub mod coalesce;
pub mod fastpath;
pub mod proxy;
pub mod server;
