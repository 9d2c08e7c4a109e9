//! How a resource learns its changes, chosen per resource by what its
//! upstream turned out to be ([`crate::state::Kind`]): [`poll`] asks a
//! plain origin (conditional GETs, write-through, the refresh hook), and
//! [`braid`] follows a Braid upstream's subscription, relays its updates
//! and applies the ones it understands.

pub mod braid;
pub mod pace;
pub mod poll;
