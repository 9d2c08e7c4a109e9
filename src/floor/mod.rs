//! The ground floor: what every layer stands on and that imports nothing
//! above it (with [`crate::braid`], [`crate::error`], [`crate::config`],
//! [`crate::metrics`]): response and request bodies ([`body`]), header
//! helpers ([`headers`]), HTTP/1.1 chunk framing ([`chunk`]), and RFC
//! 9111's rules as pure functions ([`rules`]), and the one
//! lock helper ([`sync::lock`]); the cache's phases ([`phase::CachePhase`]),
//! which `Cache-Status` and the access log are made from.

pub mod body;
pub mod chunk;
pub mod headers;
pub mod phase;
pub mod rules;
pub mod sync;
