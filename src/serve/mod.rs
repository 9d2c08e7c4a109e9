//! The subscriber's side: a subscription's 209 ([`subscribe`]), its one
//! [`cursor::Cursor`] type into either feed's window ([`cursor`]), direct delivery of one change to every
//! parked socket ([`direct`]), and braid-http's multiplexer
//! ([`multiplex`]).

pub mod cursor;
pub mod direct;
pub mod multiplex;
pub mod subscribe;
