//! The cache: RFC 9111's rules as pure functions ([`rules`]), the GET
//! path that answers from state by them ([`get`]), byte ranges of stored
//! answers ([`range`]) and the operator's purge ([`purge`]).

pub mod get;
pub mod purge;
pub mod range;
pub mod rules;

pub use rules::*;
