//! Where a resource sits: its URL and the variant within it.

use http::Request;

use crate::floor::rules::Vary;

/// Where a resource sits in the registry: the URL (path and query), and
/// the variant within it ([`crate::floor::rules::secondary_key`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    pub path: String,
    pub secondary: String,
    /// The `Vary` the secondary key was computed under.
    pub vary: Vary,
}

impl Key {
    /// Whether the variant is one credential's (the request carried
    /// `Authorization` or a cookie the key names).
    pub fn is_credentialed(&self) -> bool {
        self.secondary.contains("\ncredentials:")
    }
}

/// The URL of a request in the registry: its path and query.
pub fn path_of<B>(req: &Request<B>) -> String {
    req.uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string()
}
