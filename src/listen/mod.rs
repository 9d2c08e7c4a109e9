//! The top: listeners and connections ([`server`]: HTTP/1.1 and h2c,
//! the admin listener), the HTTP/1.1 subscription fast path
//! ([`fastpath`]) and h2c write coalescing ([`coalesce`]). It calls the
//! router and the admin handler; nothing below imports it.

pub mod coalesce;
pub mod fastpath;
pub mod server;
