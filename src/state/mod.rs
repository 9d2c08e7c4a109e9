//! The one resource model both feeds write into: a [`Resource`] per URL and
//! variant, with its current state ([`Head`]), its bounded window of
//! updates, and the order in which origin answers may be recorded
//! ([`Ticket`]); and the [`Registry`] that keys, caps and evicts them.
//! How changes are learned lives in [`crate::feed`]; this module only
//! records them.

pub mod key;
pub mod polled;
pub mod registry;
pub mod resource;
pub mod said;
pub mod stored;
pub mod version;

pub use key::{path_of, Key};
pub use registry::{Registry, RegistryLimits, Reservation};
pub use resource::{
    unheard_limit, Change, Head, History, Kind, Recording, Resource, Ticket, Tuning, Validation,
};
pub use said::{State, DENIAL_HEADERS};
pub use stored::{header_bytes, AnswerRules, Memo, Prepared, Stored};
pub use version::{announced_version, derived_version, repr_digest, strong_etag};
