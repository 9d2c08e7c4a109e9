//! The top: listeners and connections ([`server`]: HTTP/1.1 and h2c,
//! the admin listener), the HTTP/1.1 subscription fast path
//! ([`fastpath`], over TLS too, with [`replay`] handing hyper the bytes it
//! read and did not take), h2 write coalescing ([`coalesce`]) and the
//! books of idle connections ([`idle`]: idle timeout, and the idlest
//! closed when descriptors run low). It calls the
//! router and the admin handler; nothing below imports it.

pub mod coalesce;
pub mod fastpath;
pub mod idle;
pub mod replay;
pub mod server;
