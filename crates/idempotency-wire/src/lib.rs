//! The wire vocabulary of the `Idempotency-Key` protocol, shared by the server layer
//! (`idempotency-http`) and the client middleware (`idempotency-client`): the [`header`] names,
//! and the [`ProblemType`]s of the layer's `application/problem+json` answers (RFC 9457), each
//! with its slug, status, title and what a client may do next ([`Retry`]).
//!
//! ```
//! use idempotency_wire::{ProblemType, Retry, DEFAULT_PROBLEM_BASE};
//!
//! let type_uri = ProblemType::InProgress.type_uri(DEFAULT_PROBLEM_BASE);
//! assert_eq!(type_uri, "tag:idempotency,2026:problems/in-progress");
//! let read = ProblemType::from_type_uri(&type_uri, DEFAULT_PROBLEM_BASE).unwrap();
//! assert_eq!(read, ProblemType::InProgress);
//! assert_eq!(read.status(), http::StatusCode::CONFLICT);
//! assert_eq!(read.retry(), Retry::SameKey);
//! ```
//!
//! # The `type` URIs
//!
//! A problem's `type` is a base URI followed by the problem's slug (`key-reused`,
//! `in-progress` …). The default base, [`DEFAULT_PROBLEM_BASE`], is the `tag:` URI (RFC 4151)
//! `tag:idempotency,2026:problems/`. A `tag:` URI is an identifier only: nothing can be fetched
//! from it, so a client or a person who follows a default `type` never lands on content
//! someone else controls (an `https://` base under a domain the project does not own could
//! serve anything one day). Its tagging entity is the single label `idempotency`, a name that
//! is no public domain: nobody can register it, so no other party mints tags under it. A
//! service that documents its problem types on its own site sets its own base (the server's
//! `IdempotencyLayer::with_problem_base`, the client's `IdempotencyMiddleware::with_problem_base`);
//! the slugs stay the same.
//!
//! # Extension members: what to do next
//!
//! The layer's problem documents carry, beside `type`, `title`, `status` and `detail`:
//!
//! | member | values | meaning |
//! |---|---|---|
//! | `retry` ([`RETRY_MEMBER`]) | `same-key`, `new-key`, `no` ([`Retry`]) | whether and how the request may be sent again |
//! | `key_state` ([`KEY_STATE_MEMBER`]) | `pending`, `needs_review` | the key's state in the store, where the layer knows it |
//!
//! and, for the answers a retry can outlast, the `Retry-After` and
//! [`Retry-After-Ms`](header::RETRY_AFTER_MS) headers say when.

#![warn(missing_docs)]

/// The README's example, compiled as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

use http::StatusCode;
use std::fmt;

pub mod header;

/// The media type of problem documents (RFC 9457).
///
/// ```
/// assert_eq!(idempotency_wire::PROBLEM_JSON, "application/problem+json");
/// ```
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The default base of the layer's problem `type` URIs: a `tag:` URI (RFC 4151) that names the
/// types without pointing anywhere (see the [crate documentation](crate#the-type-uris)).
///
/// ```
/// use idempotency_wire::{ProblemType, DEFAULT_PROBLEM_BASE};
/// assert_eq!(ProblemType::KeyReused.type_uri(DEFAULT_PROBLEM_BASE), "tag:idempotency,2026:problems/key-reused");
/// ```
pub const DEFAULT_PROBLEM_BASE: &str = "tag:idempotency,2026:problems/";

/// The name of the extension member that says whether and how to send the request again
/// ([`Retry`]).
///
/// ```
/// assert_eq!(idempotency_wire::RETRY_MEMBER, "retry");
/// ```
pub const RETRY_MEMBER: &str = "retry";

/// The name of the extension member that gives the key's state in the store, where the layer
/// knows it ([`ProblemType::key_state`]).
///
/// ```
/// assert_eq!(idempotency_wire::KEY_STATE_MEMBER, "key_state");
/// ```
pub const KEY_STATE_MEMBER: &str = "key_state";

/// What a client may do after a problem answer: the `retry` member of the layer's problem
/// documents.
///
/// ```
/// use idempotency_wire::Retry;
/// assert_eq!(Retry::SameKey.as_str(), "same-key");
/// assert_eq!("new-key".parse::<Retry>(), Ok(Retry::NewKey));
/// assert!("later".parse::<Retry>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Retry {
    /// `same-key`: send the same request again with the same key, after the `Retry-After`
    /// (or `Retry-After-Ms`) hint when there is one. This is safe, and it is how the client
    /// gets the operation's one answer: the server runs it if nothing ran, or replays it.
    SameKey,
    /// `new-key`: the request was refused before anything ran, and the key holds nothing for
    /// it; as sent it cannot succeed. Correct it (add or fix the key, authenticate, shrink or
    /// fix the body) and send it under a new key: that is safe.
    NewKey,
    /// `no`: do not send it again on your own. Either the key belongs to another request (a bug
    /// in the caller: a new key would make a second operation, which only the caller may
    /// decide), or the operation's outcome is uncertain and a person must look.
    No,
}

impl Retry {
    /// The member's value.
    ///
    /// ```
    /// assert_eq!(idempotency_wire::Retry::No.as_str(), "no");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Retry::SameKey => "same-key",
            Retry::NewKey => "new-key",
            Retry::No => "no",
        }
    }
}

impl fmt::Display for Retry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A value that is not one of the vocabulary's names.
///
/// ```
/// use idempotency_wire::{ProblemType, UnknownName};
/// assert_eq!("teapot".parse::<ProblemType>(), Err(UnknownName("teapot".into())));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownName(pub String);

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown name {:?}", self.0)
    }
}

impl std::error::Error for UnknownName {}

impl std::str::FromStr for Retry {
    type Err = UnknownName;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        [Retry::SameKey, Retry::NewKey, Retry::No]
            .into_iter()
            .find(|retry| retry.as_str() == value)
            .ok_or_else(|| UnknownName(value.to_owned()))
    }
}

/// The problems the idempotency layer answers with, one per kind of refusal.
///
/// Each knows its slug (the last part of its `type` URI), its HTTP status, its title, what a
/// client may do next ([`Retry`]) and, where the layer knows it, the key's state.
///
/// | slug | status | retry | key_state |
/// |---|---|---|---|
/// | `key-missing` | 400 | `new-key` | |
/// | `key-invalid` | 400 | `new-key` | |
/// | `scope-missing` | 401 | `new-key` | |
/// | `body-too-large` | 413 | `new-key` | |
/// | `body-not-json` | 400 | `new-key` | |
/// | `body-unreadable` | 400 | `same-key` | |
/// | `in-progress` | 409 | `same-key`, after `Retry-After` | `pending` |
/// | `lease-lost` | 409 | `same-key`, after `Retry-After` | |
/// | `needs-review` | 409 | `no` | `needs_review` |
/// | `key-reused` | 422 | `no` | |
/// | `store-unavailable` | 503 | `same-key`, after `Retry-After` | |
/// | `internal` | 500 | `no` | |
///
/// ```
/// use idempotency_wire::{ProblemType, Retry};
/// let problem: ProblemType = "key-reused".parse().unwrap();
/// assert_eq!(problem, ProblemType::KeyReused);
/// assert_eq!(problem.status(), 422);
/// assert_eq!(problem.retry(), Retry::No);
/// assert_eq!(problem.to_string(), "key-reused");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemType {
    /// 400: the route requires an `Idempotency-Key` header and the request has none.
    KeyMissing,
    /// 400: the `Idempotency-Key` header is malformed, repeated or too long.
    KeyInvalid,
    /// 401: no scope (user, tenant) could be found for the request.
    ScopeMissing,
    /// 409: a request with the same key is still being processed; retry after `Retry-After`.
    InProgress,
    /// 409: the key is parked for an operator: an outside effect may or may not have happened.
    NeedsReview,
    /// 409: the lease on the key was lost while the handler ran; its work was rolled back, and
    /// another worker carries the operation on.
    LeaseLost,
    /// 422: the key was already used with a different request.
    KeyReused,
    /// 413: the request body is larger than the layer's limit; nothing was reserved.
    BodyTooLarge,
    /// 400: the request declares a JSON content type but its body is not JSON.
    BodyNotJson,
    /// 400: the request body could not be read; nothing was reserved.
    BodyUnreadable,
    /// 503: a durable operation did not settle in this request (an outside outcome is unknown,
    /// or it stopped after a step took effect): it is carried on in the background; retry with
    /// the same key after `Retry-After` (409 until it settles, then its answer).
    OperationPending,
    /// 503: the idempotency store cannot be reached; nothing was run.
    StoreUnavailable,
    /// 500: an internal failure (a corrupt stored response, a misused transaction extractor …).
    Internal,
}

impl ProblemType {
    /// Every problem type, in the order of the table above.
    ///
    /// ```
    /// use idempotency_wire::ProblemType;
    /// assert!(ProblemType::ALL.contains(&ProblemType::Internal));
    /// ```
    pub const ALL: [ProblemType; 13] = [
        ProblemType::KeyMissing,
        ProblemType::KeyInvalid,
        ProblemType::ScopeMissing,
        ProblemType::BodyTooLarge,
        ProblemType::BodyNotJson,
        ProblemType::BodyUnreadable,
        ProblemType::InProgress,
        ProblemType::LeaseLost,
        ProblemType::NeedsReview,
        ProblemType::KeyReused,
        ProblemType::OperationPending,
        ProblemType::StoreUnavailable,
        ProblemType::Internal,
    ];

    /// The slug: the last part of the `type` URI.
    ///
    /// ```
    /// assert_eq!(idempotency_wire::ProblemType::StoreUnavailable.slug(), "store-unavailable");
    /// ```
    pub fn slug(self) -> &'static str {
        self.facts().slug
    }

    /// The HTTP status the layer answers with.
    ///
    /// ```
    /// assert_eq!(idempotency_wire::ProblemType::BodyTooLarge.status(), 413);
    /// ```
    pub fn status(self) -> StatusCode {
        self.facts().status
    }

    /// The title: a short summary, the same for every occurrence.
    ///
    /// ```
    /// assert_eq!(idempotency_wire::ProblemType::KeyMissing.title(), "Idempotency-Key header missing");
    /// ```
    pub fn title(self) -> &'static str {
        self.facts().title
    }

    /// What a client may do next (see [`Retry`]); for [`Retry::SameKey`] the answer's
    /// `Retry-After` says when, where it has one.
    ///
    /// ```
    /// use idempotency_wire::{ProblemType, Retry};
    /// assert_eq!(ProblemType::StoreUnavailable.retry(), Retry::SameKey);
    /// assert_eq!(ProblemType::BodyNotJson.retry(), Retry::NewKey);
    /// assert_eq!(ProblemType::NeedsReview.retry(), Retry::No);
    /// ```
    pub fn retry(self) -> Retry {
        self.facts().retry
    }

    /// The key's state in the store as of this answer, where the layer knows it: `pending`
    /// (another request holds it) or `needs_review` (parked for an operator), the store's
    /// names for them. `None` where the key was not looked at, or its state may have moved on.
    ///
    /// ```
    /// use idempotency_wire::ProblemType;
    /// assert_eq!(ProblemType::InProgress.key_state(), Some("pending"));
    /// assert_eq!(ProblemType::KeyMissing.key_state(), None);
    /// ```
    pub fn key_state(self) -> Option<&'static str> {
        match self {
            ProblemType::InProgress | ProblemType::OperationPending => Some("pending"),
            ProblemType::NeedsReview => Some("needs_review"),
            _ => None,
        }
    }

    /// The `type` URI under `base` (base followed by the slug).
    ///
    /// ```
    /// use idempotency_wire::ProblemType;
    /// let uri = ProblemType::KeyReused.type_uri("https://errors.example.com/idempotency/");
    /// assert_eq!(uri, "https://errors.example.com/idempotency/key-reused");
    /// ```
    pub fn type_uri(self, base: &str) -> String {
        format!("{base}{}", self.slug())
    }

    /// The problem type named by a `type` URI under `base`: the URI must be the base followed
    /// by exactly one of the slugs. `None` for any other URI (an application's own problems,
    /// another base, `about:blank`).
    ///
    /// ```
    /// use idempotency_wire::{ProblemType, DEFAULT_PROBLEM_BASE};
    /// let base = "https://errors.example.com/idempotency/";
    /// assert_eq!(ProblemType::from_type_uri("https://errors.example.com/idempotency/lease-lost", base), Some(ProblemType::LeaseLost));
    /// assert_eq!(ProblemType::from_type_uri("https://errors.example.com/idempotency/lease-lost", DEFAULT_PROBLEM_BASE), None);
    /// assert_eq!(ProblemType::from_type_uri("https://errors.example.com/idempotency/shop/in-progress", base), None);
    /// ```
    pub fn from_type_uri(uri: &str, base: &str) -> Option<ProblemType> {
        uri.strip_prefix(base)?.parse().ok()
    }

    fn facts(self) -> &'static Facts {
        FACTS
            .iter()
            .find(|facts| facts.problem == self)
            .expect("every problem type has its facts")
    }
}

/// What one [`ProblemType`] is, in one place.
struct Facts {
    problem: ProblemType,
    slug: &'static str,
    status: StatusCode,
    title: &'static str,
    retry: Retry,
}

/// Each problem type's slug, status, title and retry advice.
const FACTS: [Facts; 13] = [
    Facts {
        problem: ProblemType::KeyMissing,
        slug: "key-missing",
        status: StatusCode::BAD_REQUEST,
        title: "Idempotency-Key header missing",
        retry: Retry::NewKey,
    },
    Facts {
        problem: ProblemType::KeyInvalid,
        slug: "key-invalid",
        status: StatusCode::BAD_REQUEST,
        title: "Idempotency-Key header invalid",
        retry: Retry::NewKey,
    },
    Facts {
        problem: ProblemType::ScopeMissing,
        slug: "scope-missing",
        status: StatusCode::UNAUTHORIZED,
        title: "Authentication required",
        retry: Retry::NewKey,
    },
    Facts {
        problem: ProblemType::BodyTooLarge,
        slug: "body-too-large",
        status: StatusCode::PAYLOAD_TOO_LARGE,
        title: "Request body too large",
        retry: Retry::NewKey,
    },
    Facts {
        problem: ProblemType::BodyNotJson,
        slug: "body-not-json",
        status: StatusCode::BAD_REQUEST,
        title: "Request body is not JSON",
        retry: Retry::NewKey,
    },
    Facts {
        problem: ProblemType::BodyUnreadable,
        slug: "body-unreadable",
        status: StatusCode::BAD_REQUEST,
        title: "Request body unreadable",
        retry: Retry::SameKey,
    },
    Facts {
        problem: ProblemType::InProgress,
        slug: "in-progress",
        status: StatusCode::CONFLICT,
        title: "A request with this Idempotency-Key is in progress",
        retry: Retry::SameKey,
    },
    Facts {
        problem: ProblemType::LeaseLost,
        slug: "lease-lost",
        status: StatusCode::CONFLICT,
        title: "The request with this Idempotency-Key took too long",
        retry: Retry::SameKey,
    },
    Facts {
        problem: ProblemType::NeedsReview,
        slug: "needs-review",
        status: StatusCode::CONFLICT,
        title: "The request with this Idempotency-Key needs review",
        retry: Retry::No,
    },
    Facts {
        problem: ProblemType::KeyReused,
        slug: "key-reused",
        status: StatusCode::UNPROCESSABLE_ENTITY,
        title: "Idempotency-Key reused with a different request",
        retry: Retry::No,
    },
    Facts {
        problem: ProblemType::OperationPending,
        slug: "operation-pending",
        status: StatusCode::SERVICE_UNAVAILABLE,
        title: "Operation pending",
        retry: Retry::SameKey,
    },
    Facts {
        problem: ProblemType::StoreUnavailable,
        slug: "store-unavailable",
        status: StatusCode::SERVICE_UNAVAILABLE,
        title: "Idempotency store unavailable",
        retry: Retry::SameKey,
    },
    Facts {
        problem: ProblemType::Internal,
        slug: "internal",
        status: StatusCode::INTERNAL_SERVER_ERROR,
        title: "Internal error",
        retry: Retry::No,
    },
];

impl fmt::Display for ProblemType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.slug())
    }
}

impl std::str::FromStr for ProblemType {
    type Err = UnknownName;

    /// Reads a slug.
    fn from_str(slug: &str) -> Result<Self, Self::Err> {
        ProblemType::ALL
            .into_iter()
            .find(|problem| problem.slug() == slug)
            .ok_or_else(|| UnknownName(slug.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_round_trips_under_any_base() {
        for base in [DEFAULT_PROBLEM_BASE, "https://errors.example.com/p/"] {
            for problem in ProblemType::ALL {
                let uri = problem.type_uri(base);
                assert_eq!(ProblemType::from_type_uri(&uri, base), Some(problem));
                assert_eq!(problem.slug().parse::<ProblemType>(), Ok(problem));
            }
        }
    }

    #[test]
    fn slugs_are_distinct_and_statuses_are_errors() {
        let mut slugs: Vec<_> = ProblemType::ALL.iter().map(|p| p.slug()).collect();
        slugs.sort_unstable();
        slugs.dedup();
        assert_eq!(slugs.len(), ProblemType::ALL.len());
        for problem in ProblemType::ALL {
            let status = problem.status();
            assert!(status.is_client_error() || status.is_server_error());
            // Only the answers a retry can outlast say to retry with the same key.
            if problem.retry() == Retry::SameKey {
                assert!(matches!(status.as_u16(), 400 | 409 | 503), "{problem}");
            }
        }
    }

    #[test]
    fn other_uris_are_not_problem_types() {
        let base = DEFAULT_PROBLEM_BASE;
        for uri in [
            "about:blank",
            "tag:idempotency,2026:problems/",
            "tag:idempotency,2026:problems/shop/in-progress",
            "tag:idempotency,2026:problems/in-progress/",
            "https://idempotency.example/problems/in-progress",
        ] {
            assert_eq!(ProblemType::from_type_uri(uri, base), None, "{uri}");
        }
    }
}
