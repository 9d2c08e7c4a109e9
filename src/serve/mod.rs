//! The subscriber's side of a request: a subscription's 209 and the
//! answers made from state ([`subscribe`]), and braid-http's multiplexer
//! ([`multiplex`]). What a subscriber follows and how it is written to is
//! [`crate::deliver`].

pub mod multiplex;
pub mod subscribe;
