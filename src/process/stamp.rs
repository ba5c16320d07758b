//! The token state and the owner stamps of one key, as laid out in the
//! key's state file and shared by every process through its mapping
//! ([`super::shared`]), and the public view of a holder it fills ([`ProcessHolder`], in `holder.rs`).
//!
//! # Layout of `<stem>.state` (format 3, 28,672 bytes, 64-bit words)
//!
//! | offset | size | what |
//! |--------|------|------|
//! | 0      | 8    | magic and format (`KLPS`, 3) |
//! | 8      | 16   | the boot id the state was last trusted under |
//! | 24     | 8    | the **state word**: `token << 6 \| slot` |
//! | 32     | 8    | the **claim word**: the claim of a waiting process (0: none) |
//! | 40     | 8    | when a judgement first deferred to that claim (monotonic ns; 0: not yet) |
//! | 48     | 8    | when a judgement first found the word's slot locked with no grant (monotonic ns; 0: not since the last grant) |
//! | 56     | 8    | the **handed word**: the highest state word whose slot the kernel handed to a waiter's helper thread while the word's grant was not released |
//! | 64     | 24   | reservation record A |
//! | 96     | 24   | reservation record B |
//! | 512    | 512  | the release cells: one token per slot |
//! | 4096   | 64 x 384 | the owner stamps: one per slot |
//!
//! The file also carries its kernel locks (its `flock` lock and the
//! byte-range locks of bytes 0 to 64, and of byte 66, the claim's; see
//! [`super::acquire`]); locks are not data, so the layout is unaffected.
//! The claim words, the no-grant word at 48 and the handed word at 56 were
//! added within format 3: files made before them hold zero there (no
//! claim, no wait for a slot locked with no grant, no slot handed), and a
//! build from before them ignores them (and never writes the handed word:
//! its helpers' slots are judged as before, a live holder's).
//!
//! The **state word** names the current grant: its token (the last one
//! handed out) and the slot its holder locks. A grant is a
//! compare-and-swap of the word from what the granter judged to the next
//! token and its own slot: of two processes judging the same word, one
//! wins; the other sees a new word and judges again.
//!
//! A **release cell** is written by the holder of its slot as it releases
//! the key (its token), before it lets the slot go: only the holder of slot
//! `n` ever writes cell `n`. The word's grant was released when its token
//! is in its slot's cell.
//!
//! An **owner stamp** (pid, token, lease deadline, grant times, host,
//! label) is written by the holder of its slot right after the grant's
//! compare-and-swap, token last (a sequence lock: the token is zeroed,
//! the fields written, the token stored; a reader accepts the fields only
//! if it read the same, expected token before and after them). A reader
//! that finds the word's token ahead of the stamp of its slot sees a grant
//! whose stamp is not written yet. Only the holder of a slot writes its
//! stamp, with one exception, the **lease word** of a stamp (its deadline
//! on the host's monotonic clock; [`NO_LEASE`] for none): `renew` moves it
//! forward by compare-and-swap, and a taker replaces a lapsed one by
//! [`TAKEN`] (a deadline long past) by compare-and-swap before it swaps the
//! state word, so a renew racing a takeover loses or wins as a whole.
//!
//! The state is never `fsync`ed: after a process crash the page cache still
//! holds it, which is all a restart of a process needs. A **reservation
//! record** holds a token ceiling `R` of the file's own: builds before the
//! directory's ceiling (see `super::dir`) handed out no token above `R`
//! before a record holding `R` or more was on disk, writing a new one,
//! [`RESERVE_BLOCK`] higher, into whichever of A and B was older or
//! invalid. This build keeps its ceiling in `keylock.dir` instead, one for
//! every key of the directory (so a new file needs no sync), and only
//! reads these records. After a reboot (the boot id in the file is not
//! this boot's) the state is not trusted: the first process to map the
//! file resets it (the next token is the higher of the highest valid
//! record and the directory's durable ceiling, plus one: above every token
//! handed out before the crash; and no holder), under the kernel lock of
//! byte 0, and then writes this boot's id.

use super::holder::ProcessHolder;
use std::fs::File;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::error::ProcessLockError;
use super::shared::Mapping;
use super::unix::{self, MAX_SLOTS};
use crate::FencingToken;

/// Bytes of a state file.
pub(crate) const FILE_LEN: usize = STAMPS_AT + MAX_SLOTS as usize * STAMP_LEN;
/// 3: the state in shared memory, a state word swapped atomically, one
/// stamp per slot (2 had a 2,048-byte file read and written under a state
/// lock; a format 2 file is refused as [`ProcessLockError::Corrupt`]).
const VERSION: u32 = 3;
const MAGIC: u64 = u64::from_le_bytes([b'K', b'L', b'P', b'S', VERSION as u8, 0, 0, 0]);
const RESERVE_MAGIC: u64 = u64::from_le_bytes([b'K', b'L', b'P', b'R', VERSION as u8, 0, 0, 0]);
const BOOT_AT: usize = 8;
const WORD_AT: usize = 24;
const CLAIM_AT: usize = 32;
const CLAIM_SINCE_AT: usize = 40;
const NO_GRANT_SINCE_AT: usize = 48;
const HANDED_AT: usize = 56;
const RESERVE_AT: [usize; 2] = [64, 96];
/// Where the ceilings live: the first page, which `msync` writes back.
#[cfg(test)]
const RESERVE_PAGE: usize = 4096;
const CELLS_AT: usize = 512;
const STAMPS_AT: usize = 4096;
const STAMP_LEN: usize = 384;
// Offsets within a stamp.
const S_TOKEN: usize = 0;
const S_LEASE: usize = 8;
const S_PID: usize = 16;
const S_MONO: usize = 24;
const S_UNIX: usize = 32;
const S_LENS: usize = 40;
const S_HOST: usize = 48;
const S_LABEL: usize = 112;

const SLOT_BITS: u32 = 6;
const _: () = assert!(1 << SLOT_BITS == MAX_SLOTS);
const _: () = assert!(S_LABEL + 256 <= STAMP_LEN);

/// How many tokens one durable reservation covers.
pub(crate) const RESERVE_BLOCK: u64 = 1024;
/// Tokens stay below this (the word keeps 58 bits of token).
pub(crate) const TOKEN_LIMIT: u64 = (1 << (64 - SLOT_BITS)) - RESERVE_BLOCK;

/// A lease word without a lease: never lapses.
pub(crate) const NO_LEASE: u64 = u64::MAX;
/// A lease word marked lapsed by a taker: a deadline long past, which a
/// renew can no longer move.
pub(crate) const TAKEN: u64 = 1;

/// The longest label accepted, in bytes.
pub const MAX_LABEL: usize = 255;
const MAX_HOST: usize = 64;

/// The state word: the current grant's token and slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Word {
    /// The last token handed out (0: none yet).
    pub(crate) token: u64,
    /// The slot the holder of `token` locks.
    pub(crate) slot: u32,
}

impl Word {
    fn pack(self) -> u64 {
        self.token << SLOT_BITS | u64::from(self.slot)
    }

    fn unpack(word: u64) -> Self {
        #[allow(clippy::cast_possible_truncation)] // six bits
        Self {
            token: word >> SLOT_BITS,
            slot: (word & u64::from(MAX_SLOTS - 1)) as u32,
        }
    }
}

/// The holder stamp as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub(crate) pid: u32,
    pub(crate) token: u64,
    /// The lease deadline on the host's monotonic clock, if any.
    pub(crate) lease_deadline: Option<u64>,
    /// When the key was granted, on the host's monotonic clock.
    pub(crate) granted_mono: u64,
    /// When the key was granted, on the wall clock (for people).
    pub(crate) granted_unix_ns: u64,
    pub(crate) host: String,
    pub(crate) label: Option<String>,
}

/// A stamp to write: [`Stamp`] with borrowed text.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NewStamp<'a> {
    pub(crate) pid: u32,
    pub(crate) token: u64,
    pub(crate) lease_deadline: Option<u64>,
    pub(crate) granted_mono: u64,
    pub(crate) granted_unix_ns: u64,
    pub(crate) host: &'a str,
    pub(crate) label: Option<&'a str>,
}

impl Stamp {
    #[cfg(test)]
    fn borrow(&self) -> NewStamp<'_> {
        NewStamp {
            pid: self.pid,
            token: self.token,
            lease_deadline: self.lease_deadline,
            granted_mono: self.granted_mono,
            granted_unix_ns: self.granted_unix_ns,
            host: &self.host,
            label: self.label.as_deref(),
        }
    }
}

fn checksum(words: &[u64]) -> u64 {
    // A multiply-xor-rotate over 64-bit words: detects torn or foreign
    // records, not an adversary. Every step is a bijection of `h`, so two
    // records that differ in one word always differ in their checksums.
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ words.len() as u64;
    for &word in words {
        h = (h ^ word).wrapping_mul(K).rotate_left(31);
    }
    h
}

fn stamp_at(slot: u32) -> usize {
    STAMPS_AT + STAMP_LEN * slot.min(MAX_SLOTS - 1) as usize
}

fn cell_at(slot: u32) -> usize {
    CELLS_AT + 8 * slot.min(MAX_SLOTS - 1) as usize
}

/// The bytes of a new state file's first page: the magic, this boot's id,
/// no grant yet, no reservation.
pub(crate) fn new_file_header() -> Vec<u8> {
    let mut page = vec![0u8; STAMPS_AT];
    page[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    page[BOOT_AT..BOOT_AT + 16].copy_from_slice(&unix::boot_id());
    page
}

/// This boot's id as two words.
pub(crate) fn boot_words() -> [u64; 2] {
    let id = unix::boot_id();
    [
        u64::from_le_bytes(id[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(id[8..].try_into().expect("8 bytes")),
    ]
}

/// Called by a helper thread the moment the kernel handed it slot `slot`
/// of `file` (a key's state file), before its future can see it: if the
/// state word names that slot and its grant is not released, records the
/// word as *handed* (`fetch_max`: words only grow, so a late record of an
/// older word never hides a newer one).
///
/// Why that record is true whenever the word still equals it: a grant's
/// holder locks its slot before the swap and keeps it until after its
/// release cell is written, and two open files never hold one slot. So if
/// the kernel handed the slot to this helper while the word named it,
/// unreleased, the word's holder had let the slot go without releasing:
/// it died. The word cannot name this slot again before the helper lets
/// it go but through the helper's own future's swap, which changes the
/// word. A judge that finds the word equal to this record and its slot
/// locked therefore knows the slot's holder made no grant (a future that
/// will swap soon, or one forgotten that never will), and treats it as a
/// slot locked with no grant (see `acquire.rs`). Errors (a file shortened
/// from outside) skip the record: the slot is then judged as before.
///
/// `page` is that first page of `file`, mapped by the helper before it
/// waited ([`HandedPage::map`]): no mapping is made or unmade, and no page
/// fault taken, between the kernel's handoff and the wake (they cost tens
/// of microseconds here). The mapping is the helper's own, made from the
/// open file it waits on and dropped with it: a mapping keeps its open
/// file alive, and with it that file's locks, so it must never outlive
/// the file it was made from (a mapping of the table's own open file
/// would keep its user byte and claim locked after the table closed it).
pub(crate) fn mark_handed(file: &File, page: &HandedPage, slot: u32) {
    let Some(map) = &page.0 else {
        return;
    };
    let Ok((_, len)) = unix::file_id(file) else {
        return;
    };
    if len < FILE_LEN as u64 {
        return; // its page could be gone: no access (`SIGBUS`)
    }
    let word = Word::unpack(map.word(WORD_AT).load(Ordering::SeqCst));
    let released =
        word.token == 0 || map.word(cell_at(word.slot)).load(Ordering::SeqCst) == word.token;
    if word.slot == slot && !released {
        map.word(HANDED_AT).fetch_max(word.pack(), Ordering::SeqCst);
    }
}

/// The first page of a key's state file (its words), mapped by a helper
/// thread from the open file it waits on, for [`mark_handed`]; `None` if
/// it could not be mapped (the record is then skipped).
#[derive(Debug)]
pub(crate) struct HandedPage(Option<Mapping>);

impl HandedPage {
    /// Maps the first page of `file` and touches it (so that its fault is
    /// taken now, not after the handoff), if the file is whole.
    pub(crate) fn map(file: &File) -> Self {
        let whole = unix::file_id(file).is_ok_and(|(_, len)| len >= FILE_LEN as u64);
        let map = whole
            .then(|| Mapping::map(file, STAMPS_AT, true).ok())
            .flatten();
        if let Some(map) = &map {
            map.word(WORD_AT).load(Ordering::Relaxed);
        }
        Self(map)
    }
}

/// A key's state, in its mapped state file.
#[derive(Debug)]
pub(crate) struct KeyState {
    map: Mapping,
}

impl KeyState {
    /// Maps a state file, refusing one that is not a format 3 state file
    /// ([`ProcessLockError::Corrupt`]). With `writable`, a state left from
    /// another boot is reset first, to the higher of its own ceiling and
    /// `ceiling`, the directory's (see the module doc).
    pub(crate) fn map(
        file: &File,
        path: &Path,
        writable: bool,
        ceiling: u64,
    ) -> Result<Self, ProcessLockError> {
        let len = file
            .metadata()
            .map_err(|e| ProcessLockError::io("stat", path, e))?
            .len();
        if len != FILE_LEN as u64 {
            return Err(ProcessLockError::Corrupt { path: path.into() });
        }
        let map = Mapping::map(file, FILE_LEN, writable)
            .map_err(|e| ProcessLockError::io("map", path, e))?;
        let state = Self { map };
        if state.map.word(0).load(Ordering::Acquire) != MAGIC {
            return Err(ProcessLockError::Corrupt { path: path.into() });
        }
        if writable && !state.this_boot() {
            state.reset_after_reboot(file, path, ceiling)?;
        }
        Ok(state)
    }

    /// Whether the state was last trusted under this boot.
    pub(crate) fn this_boot(&self) -> bool {
        let [a, b] = boot_words();
        self.map.word(BOOT_AT).load(Ordering::Acquire) == a
            && self.map.word(BOOT_AT + 8).load(Ordering::Acquire) == b
    }

    /// The first process of a boot to map the file: no holder survived
    /// and tokens may have been handed out above the word (never synced),
    /// never above the durable ceiling. Under the kernel lock of byte 0,
    /// so that exactly one process resets it.
    fn reset_after_reboot(
        &self,
        file: &File,
        path: &Path,
        ceiling: u64,
    ) -> Result<(), ProcessLockError> {
        unix::lock_range(file, unix::Kind::Exclusive, unix::BOOT_BYTE, 1)
            .map_err(|e| ProcessLockError::io("lock", path, e))?;
        if !self.this_boot() {
            let reserved = self.reserved().0.max(ceiling);
            self.word().store(
                Word {
                    token: reserved,
                    slot: 0,
                }
                .pack(),
                Ordering::SeqCst,
            );
            self.map.word(cell_at(0)).store(reserved, Ordering::SeqCst);
            self.claim().store(0, Ordering::SeqCst);
            self.claim_since().store(0, Ordering::SeqCst);
            self.no_grant_since().store(0, Ordering::SeqCst);
            let [a, b] = boot_words();
            self.map.word(BOOT_AT).store(a, Ordering::SeqCst);
            self.map.word(BOOT_AT + 8).store(b, Ordering::SeqCst);
        }
        unix::unlock_range(file, unix::BOOT_BYTE, 1)
            .map_err(|e| ProcessLockError::io("unlock", path, e))
    }

    fn word(&self) -> &std::sync::atomic::AtomicU64 {
        self.map.word(WORD_AT)
    }

    /// The claim word: the claim of the waiting process that has the next
    /// turn, if any (0: none); see `acquire.rs`.
    #[inline]
    pub(crate) fn claim(&self) -> &std::sync::atomic::AtomicU64 {
        self.map.word(CLAIM_AT)
    }

    /// When a judgement first deferred to the current claim, on the host's
    /// monotonic clock (0: none did yet).
    pub(crate) fn claim_since(&self) -> &std::sync::atomic::AtomicU64 {
        self.map.word(CLAIM_SINCE_AT)
    }

    /// When a judgement first found the word's grant released and its
    /// slot locked by another open file (no grant: a taker about to swap,
    /// or an open file that never will), on the host's monotonic clock (0:
    /// none did since the last grant); see `acquire.rs`.
    #[inline]
    pub(crate) fn no_grant_since(&self) -> &std::sync::atomic::AtomicU64 {
        self.map.word(NO_GRANT_SINCE_AT)
    }

    /// Whether the kernel handed `word`'s slot to a waiter's helper thread
    /// while `word` was the state word and its grant not released (see
    /// [`mark_handed`]): then `word`'s holder no longer holds its slot, and
    /// the open file that does made no grant.
    #[inline]
    pub(crate) fn handed(&self, word: Word) -> bool {
        word.token != 0 && self.map.word(HANDED_AT).load(Ordering::SeqCst) == word.pack()
    }

    /// The current grant.
    #[inline]
    pub(crate) fn load(&self) -> Word {
        Word::unpack(self.word().load(Ordering::SeqCst))
    }

    /// Swaps the state word from `seen` to the next token on `slot`: the
    /// grant. `Ok(None)` if the word is no longer `seen`. The next token is
    /// `seen`'s plus one, except in a file that never granted (its word's
    /// token is 0): there it is the directory's token floor plus one
    /// (`floor` is called only then), above every token of the key's
    /// reclaimed files (see `super::dir`).
    #[inline]
    pub(crate) fn swap(
        &self,
        seen: Word,
        slot: u32,
        path: &Path,
        floor: impl FnOnce() -> Result<u64, ProcessLockError>,
    ) -> Result<Option<u64>, ProcessLockError> {
        let last = if seen.token == 0 {
            floor()?
        } else {
            seen.token
        };
        let token = last.saturating_add(1);
        if token >= TOKEN_LIMIT {
            return Err(ProcessLockError::InvalidOptions {
                option: "token",
                reason: format!("the fencing tokens of `{}` are exhausted", path.display()),
            });
        }
        let next = Word { token, slot }.pack();
        Ok(self
            .word()
            .compare_exchange(seen.pack(), next, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
            .then_some(token))
    }

    /// Whether the grant of `word` was released (or there was none).
    #[inline]
    pub(crate) fn released(&self, word: Word) -> bool {
        word.token == 0 || self.map.word(cell_at(word.slot)).load(Ordering::SeqCst) == word.token
    }

    /// Writes slot `slot`'s release cell: the holder of token `token`,
    /// which holds that slot, lets the key go.
    #[inline]
    pub(crate) fn release(&self, slot: u32, token: u64) {
        self.map.word(cell_at(slot)).store(token, Ordering::SeqCst);
    }

    /// The lease word of slot `slot`'s stamp (see the module doc).
    #[inline]
    pub(crate) fn lease(&self, slot: u32) -> &std::sync::atomic::AtomicU64 {
        self.map.word(stamp_at(slot) + S_LEASE)
    }

    /// The lease word of the grant `word`, if the stamp of its slot is
    /// its stamp (`None`: not written yet).
    #[inline]
    pub(crate) fn lease_of(&self, word: Word) -> Option<u64> {
        let at = stamp_at(word.slot);
        (self.map.word(at + S_TOKEN).load(Ordering::Acquire) == word.token)
            .then(|| self.lease(word.slot).load(Ordering::SeqCst))
    }

    /// The durable ceiling, and which record to overwrite next.
    fn reserved(&self) -> (u64, usize) {
        let read = |at: usize| {
            let w = [0, 8, 16].map(|o| self.map.word(at + o).load(Ordering::Acquire));
            (w[0] == RESERVE_MAGIC && checksum(&w[..2]) == w[2]).then_some(w[1])
        };
        let records = RESERVE_AT.map(read);
        let reserved = records.iter().flatten().copied().max().unwrap_or(0);
        // Overwrite the invalid record, else the lower one.
        let next = match records {
            [None, _] => 0,
            [_, None] => 1,
            [Some(a), Some(b)] => usize::from(b < a),
        };
        (reserved, next)
    }

    /// Writes and syncs a ceiling of the file's own at or above `token`,
    /// as builds before the directory's ceiling did (this build keeps its
    /// ceiling in `keylock.dir` and only reads these records, when it
    /// resets a file after a reboot): the tests forge such files with it.
    #[cfg(test)]
    pub(crate) fn reserve(&self, token: u64, path: &Path) -> Result<bool, ProcessLockError> {
        let (reserved, next) = self.reserved();
        if token <= reserved {
            return Ok(false);
        }
        let ceiling = token + RESERVE_BLOCK;
        let at = RESERVE_AT[next];
        self.map.word(at).store(RESERVE_MAGIC, Ordering::Release);
        self.map.word(at + 8).store(ceiling, Ordering::Release);
        let sum = checksum(&[RESERVE_MAGIC, ceiling]);
        self.map.word(at + 16).store(sum, Ordering::Release);
        self.map
            .sync(RESERVE_PAGE)
            .map_err(|err| ProcessLockError::io("reserve fencing tokens in", path, err))?;
        Ok(true)
    }

    /// Writes slot `slot`'s stamp (its holder does, right after its grant).
    pub(crate) fn write_stamp(&self, slot: u32, stamp: &NewStamp<'_>) {
        let at = stamp_at(slot);
        let w = |o: usize| self.map.word(at + o);
        w(S_TOKEN).store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        w(S_LEASE).store(stamp.lease_deadline.unwrap_or(NO_LEASE), Ordering::Relaxed);
        w(S_PID).store(u64::from(stamp.pid), Ordering::Relaxed);
        w(S_MONO).store(stamp.granted_mono, Ordering::Relaxed);
        w(S_UNIX).store(stamp.granted_unix_ns, Ordering::Relaxed);
        let host = cut(stamp.host, MAX_HOST);
        let label = stamp.label.map(|l| cut(l, MAX_LABEL));
        let lens = host.len() as u64
            | (label.map_or(0, str::len) as u64) << 8
            | u64::from(label.is_some()) << 16;
        w(S_LENS).store(lens, Ordering::Relaxed);
        put_text(host.as_bytes(), |i, v| {
            w(S_HOST + 8 * i).store(v, Ordering::Relaxed)
        });
        if let Some(label) = label {
            put_text(label.as_bytes(), |i, v| {
                w(S_LABEL + 8 * i).store(v, Ordering::Relaxed);
            });
        }
        w(S_TOKEN).store(stamp.token, Ordering::Release);
    }

    /// Reads the stamp of the grant `word`: `None` if the stamp of its slot
    /// is not (or not yet) that grant's, or was being rewritten.
    pub(crate) fn read_stamp(&self, word: Word) -> Option<Stamp> {
        let at = stamp_at(word.slot);
        let w = |o: usize| self.map.word(at + o).load(Ordering::Relaxed);
        let before = self.map.word(at + S_TOKEN).load(Ordering::Acquire);
        if before != word.token || before == 0 {
            return None;
        }
        let lease = w(S_LEASE);
        let pid = w(S_PID);
        let granted_mono = w(S_MONO);
        let granted_unix_ns = w(S_UNIX);
        let lens = w(S_LENS);
        #[allow(clippy::cast_possible_truncation)] // masked to a byte
        let (host_len, label_len) = ((lens & 0xFF) as usize, (lens >> 8 & 0xFF) as usize);
        let host = get_text(host_len.min(MAX_HOST), |i| w(S_HOST + 8 * i));
        let label = (lens >> 16 & 1 != 0).then(|| get_text(label_len, |i| w(S_LABEL + 8 * i)));
        fence(Ordering::Acquire);
        let after = self.map.word(at + S_TOKEN).load(Ordering::Relaxed);
        (after == before).then(|| Stamp {
            #[allow(clippy::cast_possible_truncation)] // written from a u32
            pid: pid as u32,
            token: before,
            lease_deadline: (lease != NO_LEASE).then_some(lease),
            granted_mono,
            granted_unix_ns,
            host,
            label,
        })
    }
}

/// `s` cut to at most `max` bytes, on a character boundary.
fn cut(s: &str, max: usize) -> &str {
    let mut len = s.len().min(max);
    while !s.is_char_boundary(len) {
        len -= 1;
    }
    &s[..len]
}

fn put_text(bytes: &[u8], mut store: impl FnMut(usize, u64)) {
    for (i, chunk) in bytes.chunks(8).enumerate() {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        store(i, u64::from_le_bytes(word));
    }
}

fn get_text(len: usize, load: impl Fn(usize) -> u64) -> String {
    let bytes: Vec<u8> = (0..len.div_ceil(8))
        .flat_map(|i| load(i).to_le_bytes())
        .take(len)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Makes `file` (new, empty) a state file: allocates all its blocks (a
/// full disk fails here, never at a later store into the mapping) and
/// writes its header (magic, this boot's id, no grant). No disk sync: its
/// tokens are covered by the directory's durable ceiling, not by the file
/// (see `super::dir`), so losing the file to a power loss loses no token.
pub(crate) fn init_file(file: &File) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    unix::allocate(file, FILE_LEN as u64)?;
    file.write_all_at(&new_file_header(), 0)
}

impl Stamp {
    /// The public view of this stamp's holder, judged at `now_mono` (none
    /// for a stamp without a grant).
    pub(crate) fn holder(&self, alive: bool, now_mono: u64) -> Option<ProcessHolder> {
        Some(ProcessHolder {
            pid: self.pid,
            alive,
            token: FencingToken::new(self.token)?,
            held_for: Duration::from_nanos(now_mono.saturating_sub(self.granted_mono)),
            lease_left: self
                .lease_deadline
                .map(|d| Duration::from_nanos(d.saturating_sub(now_mono))),
            granted_at: UNIX_EPOCH + Duration::from_nanos(self.granted_unix_ns),
            hostname: self.host.clone(),
            label: self.label.clone(),
        })
    }
}

/// The wall clock in nanoseconds since the epoch (0 if it is before it).
pub(crate) fn unix_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    fn stamp(token: u64) -> Stamp {
        Stamp {
            pid: 42,
            token,
            lease_deadline: Some(123),
            granted_mono: 100,
            granted_unix_ns: 5,
            host: "h".repeat(80),
            label: Some("é".repeat(200)),
        }
    }

    fn temp(name: &str) -> (std::path::PathBuf, std::path::PathBuf, File) {
        let dir = std::env::temp_dir().join(format!("keylock-stamp-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        init_file(&file).unwrap();
        (dir, path, file)
    }

    #[test]
    #[cfg_attr(miri, ignore = "maps files: not under miri")]
    fn a_stamp_round_trips_with_long_text_cut_on_char_boundaries() {
        let (dir, path, file) = temp("round");
        let state = KeyState::map(&file, &path, true, 0).unwrap();
        let word = state.load();
        assert_eq!(word, Word { token: 0, slot: 0 });
        assert!(state.released(word));
        let token = state.swap(word, 3, &path, || Ok(0)).unwrap().unwrap();
        assert_eq!(token, 1);
        assert_eq!(
            state.swap(word, 3, &path, || Ok(0)).unwrap(),
            None,
            "stale word"
        );
        let word = state.load();
        assert_eq!(word, Word { token: 1, slot: 3 });
        assert!(!state.released(word));
        assert_eq!(state.read_stamp(word), None, "not written yet");
        assert_eq!(state.lease_of(word), None);
        state.write_stamp(3, &stamp(1).borrow());
        let read = state.read_stamp(word).unwrap();
        assert_eq!(read.host.len(), MAX_HOST);
        assert_eq!(
            read.label.as_ref().unwrap().len(),
            254,
            "127 two-byte chars"
        );
        assert_eq!(read.lease_deadline, Some(123));
        assert_eq!(state.lease_of(word), Some(123));
        // Another process sees the same memory.
        let other = KeyState::map(&file, &path, false, 0).unwrap();
        assert_eq!(other.read_stamp(word), Some(read));
        state.release(3, 1);
        assert!(other.released(other.load()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "maps files: not under miri")]
    fn a_stamp_being_rewritten_or_of_another_grant_is_not_read() {
        let (dir, path, file) = temp("torn");
        let state = KeyState::map(&file, &path, true, 0).unwrap();
        let word = Word { token: 7, slot: 2 };
        state.write_stamp(2, &stamp(7).borrow());
        assert!(state.read_stamp(word).is_some());
        // A writer between its zeroing of the token and its last store.
        let token = state.map.word(stamp_at(2) + S_TOKEN);
        token.store(0, Ordering::SeqCst);
        assert_eq!(state.read_stamp(word), None);
        // The stamp of an older grant of the slot.
        token.store(6, Ordering::SeqCst);
        assert_eq!(state.read_stamp(word), None);
        assert_eq!(state.lease_of(word), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The stamp's sequence lock, raced: a writer re-stamps the slot for
    /// grant after grant (tokens increasing, as a slot's are; every field
    /// derived from the token) while a reader, through a mapping of its own
    /// as another process would have, reads the stamp of the grant whose
    /// token it just saw. An accepted stamp is always all one grant's: a
    /// writer that stopped zeroing the token before its stores would let
    /// the reader accept a stamp mixing two grants' fields.
    #[test]
    #[cfg_attr(miri, ignore = "maps files: not under miri")]
    fn a_reader_racing_a_re_stamping_writer_never_accepts_a_mixed_stamp() {
        use std::sync::atomic::AtomicBool;
        const GRANTS: u64 = 100_000;
        let (dir, path, file) = temp("race");
        let writer = KeyState::map(&file, &path, true, 0).unwrap();
        let reader = KeyState::map(&file, &path, false, 0).unwrap();
        let of = |token: u64| Stamp {
            pid: u32::try_from(token).unwrap(),
            token,
            lease_deadline: Some(token * 3),
            granted_mono: token * 5,
            granted_unix_ns: token * 7,
            host: format!("host-{token}"),
            label: Some(format!("label-{token}")),
        };
        let stamps: Vec<Stamp> = (1..=GRANTS).map(of).collect();
        let done = AtomicBool::new(false);
        let accepted = std::thread::scope(|s| {
            // Bounded, so that a failed assertion below ends the test.
            s.spawn(|| {
                for stamp in &stamps {
                    writer.write_stamp(0, &stamp.borrow());
                }
                done.store(true, Ordering::SeqCst);
            });
            let mut accepted = 0u64;
            while !done.load(Ordering::SeqCst) {
                let token = reader
                    .map
                    .word(stamp_at(0) + S_TOKEN)
                    .load(Ordering::SeqCst);
                if token == 0 {
                    continue;
                }
                if let Some(read) = reader.read_stamp(Word { token, slot: 0 }) {
                    assert_eq!(read, of(token), "a stamp mixing two grants' fields");
                    accepted += 1;
                }
            }
            accepted
        });
        eprintln!("{accepted} stamps accepted, each whole");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "maps files: not under miri")]
    fn after_a_reboot_tokens_restart_above_the_durable_ceiling() {
        let (dir, path, file) = temp("reboot");
        let state = KeyState::map(&file, &path, true, 0).unwrap();
        for _ in 0..5 {
            let word = state.load();
            let token = state.swap(word, 0, &path, || Ok(0)).unwrap().unwrap();
            state.reserve(token, &path).unwrap();
            state.write_stamp(0, &stamp(token).borrow());
        }
        assert_eq!(state.load().token, 5);
        assert_eq!(state.reserved().0, 1 + RESERVE_BLOCK);
        // Forge another boot: the word is not trusted, the holder is gone.
        state.map.word(BOOT_AT).fetch_xor(0xFF, Ordering::SeqCst);
        drop(state);
        let after = KeyState::map(&file, &path, true, 0).unwrap();
        assert!(after.this_boot());
        let word = after.load();
        assert_eq!(word.token, 1 + RESERVE_BLOCK);
        assert!(after.released(word));
        // A torn reservation falls back on the other one.
        let token = word.token + 1;
        after.swap(word, 0, &path, || Ok(0)).unwrap().unwrap();
        after.reserve(token, &path).unwrap();
        let (higher, next) = after.reserved();
        assert_eq!(higher, token + RESERVE_BLOCK);
        after
            .map
            .word(RESERVE_AT[1 - next] + 8)
            .store(0xAAAA, Ordering::SeqCst);
        let (torn, _) = after.reserved();
        assert!(torn < higher && torn > 0);
        // The directory's ceiling, when higher, wins: a file whose own
        // records were never synced (this build's) restarts above it.
        after.map.word(BOOT_AT).fetch_xor(0xFF, Ordering::SeqCst);
        drop(after);
        let again = KeyState::map(&file, &path, true, 1 << 20).unwrap();
        let word = again.load();
        assert_eq!(word.token, 1 << 20);
        assert!(again.released(word));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "maps files: not under miri")]
    fn a_file_that_never_granted_starts_above_the_directory_floor() {
        let (dir, path, file) = temp("floor");
        let state = KeyState::map(&file, &path, true, 0).unwrap();
        let word = state.load();
        assert_eq!(word.token, 0);
        let token = state.swap(word, 0, &path, || Ok(41)).unwrap().unwrap();
        assert_eq!(token, 42);
        // Once it granted, the floor is not read again.
        let token = state
            .swap(state.load(), 0, &path, || panic!("floor read"))
            .unwrap()
            .unwrap();
        assert_eq!(token, 43);
        // A floor that cannot be read fails the grant, changing nothing.
        let (dir2, path2, file2) = temp("floor-err");
        let fresh = KeyState::map(&file2, &path2, true, 0).unwrap();
        let err = fresh.swap(fresh.load(), 0, &path2, || {
            Err(ProcessLockError::Corrupt {
                path: path2.clone(),
            })
        });
        assert!(err.is_err());
        assert_eq!(fresh.load().token, 0);
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&dir2).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "maps files: not under miri")]
    fn files_that_are_not_format_3_state_files_are_refused() {
        let (dir, path, file) = temp("garbage");
        file.write_all_at(b"not a keylock file", 0).unwrap();
        assert!(matches!(
            KeyState::map(&file, &path, true, 0),
            Err(ProcessLockError::Corrupt { .. })
        ));
        // A format 2 file: 2,048 bytes, magic `KLPS`, version 2.
        file.set_len(0).unwrap();
        let mut old = vec![0u8; 2048];
        old[..4].copy_from_slice(b"KLPS");
        old[4..8].copy_from_slice(&2u32.to_le_bytes());
        file.write_all_at(&old, 0).unwrap();
        assert!(matches!(
            KeyState::map(&file, &path, true, 0),
            Err(ProcessLockError::Corrupt { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
