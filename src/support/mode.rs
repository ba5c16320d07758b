//! Lock modes: shared (many holders at once) and exclusive (one holder).

use std::fmt;

/// How a grant holds its key: alone, or together with other shared grants.
///
/// Shared grants of one key are held at once; an exclusive grant excludes
/// every other grant. Modes are ordered by strength: `Shared < Exclusive`,
/// so the stronger of two requests is their [`max`](Ord::max).
///
/// ```
/// use keylock::Mode;
/// assert!(Mode::Shared.is_compatible_with(Mode::Shared));
/// assert!(!Mode::Shared.is_compatible_with(Mode::Exclusive));
/// assert_eq!(Mode::Shared.max(Mode::Exclusive), Mode::Exclusive);
/// assert_eq!(Mode::default(), Mode::Exclusive);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Mode {
    /// Held together with any other shared grants (a reader).
    Shared,
    /// Held alone (a writer); what a plain `lock` takes.
    #[default]
    Exclusive,
}

impl Mode {
    /// Whether a grant in this mode may be held together with one in `other`:
    /// only two shared grants may.
    #[inline]
    #[must_use]
    pub const fn is_compatible_with(self, other: Mode) -> bool {
        matches!((self, other), (Mode::Shared, Mode::Shared))
    }

    /// Whether this mode is at least as strong as `other` (a holder in this
    /// mode already has what `other` would give).
    #[inline]
    #[must_use]
    pub const fn covers(self, other: Mode) -> bool {
        matches!(
            (self, other),
            (Mode::Exclusive, _) | (Mode::Shared, Mode::Shared)
        )
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Shared => "shared",
            Mode::Exclusive => "exclusive",
        })
    }
}
