//! The subscriber's side: a subscription's 209 and its cursor into the
//! shared window ([`subscribe`]), direct delivery of one change to every
//! parked socket ([`direct`]), and braid-http's multiplexer
//! ([`multiplex`]).

pub mod direct;
pub mod multiplex;
pub mod subscribe;
