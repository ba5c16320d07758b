//! The holder set of one key: who holds it now, and in which mode.
//!
//! A key is held by nobody, by one exclusive grant, or by one or more shared
//! grants. Each grant is a [`Holder`]: its token, its lease deadline and when
//! it was made. The first holder lives inline (an exclusive grant, or the
//! only reader, costs no allocation); further shared holders live in a
//! vector taken when the second reader arrives. The vectors come from, and
//! go back to, a small per-shard pool ([`HolderSpares`]), so that readers
//! coming and going do not call the allocator under the shard lock (where a
//! contended allocator would stall every thread spinning on the shard).

use crate::support::mode::Mode;
use crate::support::spares::Spares;
use crate::support::token::FencingToken;
use crate::time::clock::{Now, Stamp};

/// One grant of a key.
#[derive(Debug, Clone, Copy)]
pub(super) struct Holder {
    pub(super) token: FencingToken,
    /// When the grant loses its authority, if it has a lease.
    pub(super) deadline: Stamp,
    /// When the grant was made, if the clock was read then.
    pub(super) since: Stamp,
    /// The transaction the grant is for (0: none).
    pub(super) owner: u64,
}

impl Holder {
    /// Whether the grant still has authority at `now` (read only if needed).
    #[inline]
    pub(super) fn is_live(&self, now: &mut Now<'_>) -> bool {
        !self.deadline.is_some() || now.is_before(self.deadline)
    }
}

/// The grants holding one key, all in one mode.
#[derive(Debug, Default)]
pub(super) struct Holders {
    first: Option<Holder>,
    /// Shared holders beyond the first (`None` until a second one comes,
    /// and again once they have all gone: never empty).
    rest: Option<RestHolders>,
}

/// Holders beyond the first. Boxed: one word in every entry rather than
/// three, for the rare key with several readers at once.
#[allow(clippy::box_collection)]
type RestHolders = Box<Vec<Holder>>;

impl Holders {
    /// One holder.
    #[inline]
    pub(super) fn one(holder: Holder) -> Self {
        Self {
            first: Some(holder),
            rest: None,
        }
    }

    /// Whether nobody holds the key (then nothing is allocated either: the
    /// first holder leaves last).
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        debug_assert!(self.first.is_some() || self.rest.is_none());
        self.first.is_none()
    }

    /// How many grants hold the key.
    #[cfg_attr(not(feature = "test-util"), allow(dead_code))]
    pub(super) fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.as_ref().map_or(0, |r| r.len())
    }

    /// The holder, if exactly one grant holds the key.
    #[inline]
    pub(super) fn only(&self) -> Option<&Holder> {
        match &self.rest {
            Some(_) => None,
            None => self.first.as_ref(),
        }
    }

    /// Some holder (the first, kept the oldest unless it left), for a
    /// diagnosis.
    #[inline]
    pub(super) fn any(&self) -> Option<&Holder> {
        self.first.as_ref()
    }

    /// Whether `token`'s grant is the only holder.
    #[inline(always)]
    pub(super) fn is_only(&self, token: FencingToken) -> bool {
        matches!(self.first, Some(first) if first.token == token) && self.rest.is_none()
    }

    /// Removes the holder when it is the only one.
    #[inline(always)]
    pub(super) fn clear_only(&mut self) {
        debug_assert!(self.only().is_some());
        self.first = None;
    }

    /// Puts `holder` in the place of the only holder.
    #[inline(always)]
    pub(super) fn replace_only(&mut self, holder: Holder) {
        debug_assert!(self.only().is_some());
        self.first = Some(holder);
    }

    /// Adds a holder (the caller keeps the key's mode consistent).
    ///
    /// Inline always, so that the holder goes from the caller's registers
    /// into the entry: passed to a call through memory, it was read back
    /// with wider loads than the stores that wrote it (a store-forwarding
    /// stall on every handoff).
    #[inline(always)]
    pub(super) fn push(&mut self, holder: Holder, spares: &mut HolderSpares) {
        if self.first.is_none() {
            self.first = Some(holder);
        } else {
            self.push_rest(holder, spares);
        }
    }

    /// A further shared holder.
    #[inline(never)]
    fn push_rest(&mut self, holder: Holder, spares: &mut HolderSpares) {
        self.rest.get_or_insert_with(|| spares.take()).push(holder);
    }

    /// The grant with `token`, if it holds the key.
    #[inline]
    pub(super) fn get_mut(&mut self, token: FencingToken) -> Option<&mut Holder> {
        match &mut self.first {
            Some(first) if first.token == token => return Some(first),
            _ => {}
        }
        self.rest.as_mut()?.iter_mut().find(|h| h.token == token)
    }

    /// The transaction of the grant with `token` (0: none, or no such
    /// grant).
    #[inline]
    pub(super) fn owner_of(&self, token: FencingToken) -> u64 {
        self.get(token).map_or(0, |h| h.owner)
    }

    /// The grant with `token`, if it holds the key.
    #[inline]
    pub(super) fn get(&self, token: FencingToken) -> Option<&Holder> {
        match &self.first {
            Some(first) if first.token == token => return Some(first),
            _ => {}
        }
        self.rest.as_ref()?.iter().find(|h| h.token == token)
    }

    /// Removes the grant with `token`, if it holds the key.
    #[inline]
    pub(super) fn remove(
        &mut self,
        token: FencingToken,
        spares: &mut HolderSpares,
    ) -> Option<Holder> {
        match self.first {
            Some(first) if first.token == token => {
                self.first = self.rest.as_mut().and_then(|rest| rest.pop());
                self.return_empty_rest(spares);
                Some(first)
            }
            _ => {
                let rest = self.rest.as_mut()?;
                let at = rest.iter().position(|h| h.token == token)?;
                let removed = rest.swap_remove(at);
                self.return_empty_rest(spares);
                Some(removed)
            }
        }
    }

    /// Keeps `rest` `None` rather than empty, so that a lone holder is
    /// recognized by one check; its vector goes back to the pool.
    #[inline]
    fn return_empty_rest(&mut self, spares: &mut HolderSpares) {
        if self.rest.as_ref().is_some_and(|rest| rest.is_empty()) {
            if let Some(rest) = self.rest.take() {
                spares.give(rest);
            }
        }
    }

    /// Every holder, in no particular order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Holder> {
        self.first
            .iter()
            .chain(self.rest.iter().flat_map(|rest| rest.iter()))
    }

    /// The earliest lease deadline among the holders (none: no holder has
    /// a lease).
    #[inline]
    pub(super) fn earliest_deadline(&self) -> Stamp {
        let Some(first) = &self.first else {
            return Stamp::NONE;
        };
        let Some(rest) = &self.rest else {
            return first.deadline;
        };
        rest.iter().fold(first.deadline, |earliest, h| {
            match (earliest.is_some(), h.deadline.is_some()) {
                (true, true) => earliest.min(h.deadline),
                (false, _) => h.deadline,
                (true, false) => earliest,
            }
        })
    }

    /// Whether any holder's lease has lapsed at `now`.
    #[inline]
    pub(super) fn any_lapsed(&self, now: &mut Now<'_>) -> bool {
        match &self.first {
            None => false,
            Some(first) => {
                !first.is_live(now)
                    || self
                        .rest
                        .as_ref()
                        .is_some_and(|rest| rest.iter().any(|h| !h.is_live(now)))
            }
        }
    }

    /// Whether a grant in `mode` may join the holders now held in `held`.
    #[inline]
    pub(super) fn admits(&self, held: Mode, mode: Mode) -> bool {
        self.is_empty() || held.is_compatible_with(mode)
    }
}

/// How many empty holder vectors a shard keeps for reuse.
const SPARES: usize = 8;

/// The largest vector (in holders) a shard keeps: one grown by a crowd of
/// readers is freed when they have gone, so that a burst does not pin its
/// memory for ever.
const SPARE_CAPACITY: usize = 16;

/// A shard's empty vectors for holders beyond the first, kept for reuse.
/// Touched only under the shard lock.
#[derive(Debug, Default)]
pub(crate) struct HolderSpares(Spares<RestHolders, SPARES>);

impl HolderSpares {
    /// An empty vector: a spare one if there is one, else a new one.
    #[inline]
    fn take(&mut self) -> RestHolders {
        self.0
            .take()
            .unwrap_or_else(|| Box::new(Vec::with_capacity(4)))
    }

    /// Keeps the emptied `rest` for reuse, or frees it when the pool is
    /// full or the vector grew past [`SPARE_CAPACITY`].
    #[inline]
    fn give(&mut self, rest: RestHolders) {
        debug_assert!(rest.is_empty());
        if rest.capacity() <= SPARE_CAPACITY {
            self.0.give(rest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Holder, HolderSpares, Holders, SPARES, SPARE_CAPACITY};
    use crate::support::token::FencingToken;
    use crate::time::clock::Stamp;

    fn holder(token: u64) -> Holder {
        Holder {
            token: FencingToken::from_raw(token),
            deadline: Stamp::NONE,
            since: Stamp::NONE,
            owner: 0,
        }
    }

    #[test]
    fn readers_leaving_return_their_vector_and_the_next_readers_reuse_it() {
        let mut spares = HolderSpares::default();
        let mut holders = Holders::default();
        for t in 1..=3 {
            holders.push(holder(t), &mut spares);
        }
        let vector: *const Vec<Holder> = &**holders.rest.as_ref().unwrap();
        assert_eq!(holders.len(), 3);
        for t in [2, 1, 3] {
            assert_eq!(
                holders
                    .remove(FencingToken::from_raw(t), &mut spares)
                    .unwrap()
                    .token
                    .get(),
                t
            );
        }
        assert!(holders.is_empty() && holders.rest.is_none());
        assert_eq!(spares.0.count(), 1);
        holders.push(holder(4), &mut spares);
        holders.push(holder(5), &mut spares);
        assert_eq!(spares.0.count(), 0);
        assert!(std::ptr::eq(&**holders.rest.as_ref().unwrap(), vector));
    }

    #[test]
    fn the_pool_keeps_at_most_its_capacity() {
        let mut spares = HolderSpares::default();
        let mut keys: Vec<Holders> = (0..SPARES as u64 + 3)
            .map(|k| {
                let mut h = Holders::default();
                h.push(holder(2 * k + 1), &mut spares);
                h.push(holder(2 * k + 2), &mut spares);
                h
            })
            .collect();
        for (k, h) in keys.iter_mut().enumerate() {
            h.remove(FencingToken::from_raw(2 * k as u64 + 2), &mut spares);
            assert!(h.only().is_some());
        }
        assert_eq!(spares.0.count(), SPARES);
    }

    #[test]
    fn a_vector_grown_by_a_crowd_of_readers_is_not_kept() {
        let mut spares = HolderSpares::default();
        let mut holders = Holders::default();
        let crowd = 2 * SPARE_CAPACITY as u64;
        for t in 1..=crowd {
            holders.push(holder(t), &mut spares);
        }
        for t in 1..=crowd {
            holders.remove(FencingToken::from_raw(t), &mut spares);
        }
        assert!(holders.is_empty());
        assert_eq!(spares.0.count(), 0);
    }
}
