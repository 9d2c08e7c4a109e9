//! Delivery: what subscribers follow and how it reaches their sockets,
//! for either feed. A [`window::Window`] is a resource's updates as
//! subscribers see them (each feed implements it); a subscriber is a
//! position in one: a [`cursor::Cursor`] on its own task, or parked in the
//! window's [`direct::Parked`] set and written to by one sweep per change.
//! Below the state and the feeds; it knows neither.

pub mod cursor;
pub mod direct;
pub mod socket;
pub mod window;
