//! The cache: the GET path that answers from state by RFC 9111's rules
//! ([`get`]; the rules themselves are pure functions on the floor,
//! [`crate::floor::rules`]), byte ranges of stored answers ([`range`]) and
//! the operator's purge ([`purge`]).

pub mod get;
pub mod purge;
pub mod range;
