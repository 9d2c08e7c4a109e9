//! The cache: RFC 9111's rules as pure functions ([`rules`]) and the GET
//! path that answers from state by them ([`get`]).

pub mod get;
pub mod rules;

pub use rules::*;
