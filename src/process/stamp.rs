//! The owner stamp and the token state of one key, as stored in the key's
//! state file, and the public view of a holder ([`ProcessHolder`]).
//!
//! # Layout of `<stem>.state` (2,048 bytes, little-endian)
//!
//! | offset | size | what |
//! |--------|------|------|
//! | 0      | 512  | the state record: last token, current slot, holder stamp |
//! | 512    | 32   | reservation record A |
//! | 1024   | 32   | reservation record B |
//! | 1536   | 512  | the release cells: one token (8 bytes) per slot |
//!
//! The file's *bytes* 0 to 64 also carry its kernel locks (see
//! [`super::acquire`]); locks are not data, so the layout above is unaffected.
//!
//! A **release cell** is written by the holder of its slot as it releases
//! the key, with its token, without the state lock: only the holder of slot
//! `n` ever writes cell `n`, and it does so while it still holds the slot.
//! A stamp whose token is in its slot's cell was released (the key is free);
//! one whose token is not, and whose slot is free, names a holder that died.
//! A torn read of a cell (a concurrent release) reads as "not released",
//! which leads to the same judgement as a released stamp: the slot is free,
//! the key is taken over on it.
//!
//! The **state record** is rewritten in place on every grant and release,
//! under the key's short kernel lock, and never `fsync`ed: after a process
//! crash the page cache still holds it, which is all a restart of a process
//! needs. It carries the boot id it was written under.
//!
//! A **reservation record** holds a token ceiling `R`: no token above `R` is
//! ever handed out before a record holding `R` or more is on disk
//! (`fdatasync`). A grant that would pass the ceiling first writes a new one,
//! [`RESERVE_BLOCK`] higher, into whichever of A and B is older or invalid,
//! and syncs it; so one grant in `RESERVE_BLOCK` pays a disk sync, and a torn
//! write of one record (power lost during the write) leaves the other,
//! older, ceiling intact. After a reboot (the state record's boot id is not
//! this boot's, or the record is torn) the state record is not trusted: the
//! next token is the highest valid ceiling plus one, above every token
//! handed out before the crash. Every record carries a checksum.

use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::error::ProcessLockError;
use super::unix;
use crate::FencingToken;

/// Bytes of a state file.
pub(crate) const FILE_LEN: usize = 2048;
const STATE_LEN: usize = 512;
const RESERVE_AT: [usize; 2] = [512, 1024];
const RESERVE_LEN: usize = 32;
const STATE_MAGIC: &[u8; 4] = b"KLPS";
const RESERVE_MAGIC: &[u8; 4] = b"KLPR";
/// 2: release cells, a word-wise checksum, and the kernel locks on bytes
/// of the state file (1 had slot files; a directory used by version 1 must
/// not be shared with version 2, and a version 1 state file is refused as
/// [`ProcessLockError::Corrupt`]).
const VERSION: u32 = 2;
const CELLS_AT: usize = 1536;

/// The most slots a key may use (one per stuck holder taken over).
pub(crate) const MAX_SLOTS: u32 = 64;

/// The offset of slot `slot`'s release cell.
fn cell_at(slot: u32) -> usize {
    CELLS_AT + 8 * slot.min(MAX_SLOTS - 1) as usize
}

/// How many tokens one durable reservation covers.
pub(crate) const RESERVE_BLOCK: u64 = 1024;

/// The longest label accepted, in bytes.
pub const MAX_LABEL: usize = 255;
const MAX_HOST: usize = 64;

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

/// A key's state as read under its kernel lock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct State {
    /// The last token handed out for the key (0: none yet).
    pub(crate) last_token: u64,
    /// The slot the holder locks (or the last holder locked).
    pub(crate) slot: u32,
    pub(crate) holder: Option<Stamp>,
    /// The durable token ceiling.
    pub(crate) reserved: u64,
    /// Which reservation record is older or invalid: the next to write.
    reserve_next: usize,
    /// The release cell of `slot`: the token of the last holder of that
    /// slot that released it.
    pub(crate) released: u64,
}

fn checksum(bytes: &[u8]) -> u64 {
    // A multiply-xor-rotate over 64-bit words: detects torn or foreign
    // records, not an adversary. Every step is a bijection of `h`, so two
    // records that differ in one word always differ in their checksums.
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        let word = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        h = (h ^ word).wrapping_mul(K).rotate_left(31);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(K).rotate_left(31);
    }
    h
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"))
}

fn decode_reserve(buf: &[u8]) -> Option<u64> {
    if &buf[0..4] != RESERVE_MAGIC || u32_at(buf, 4) != VERSION {
        return None;
    }
    (checksum(&buf[..24]) == u64_at(buf, 24)).then(|| u64_at(buf, 8))
}

fn encode_reserve(reserved: u64) -> [u8; RESERVE_LEN] {
    let mut buf = [0u8; RESERVE_LEN];
    buf[0..4].copy_from_slice(RESERVE_MAGIC);
    buf[4..8].copy_from_slice(&VERSION.to_le_bytes());
    buf[8..16].copy_from_slice(&reserved.to_le_bytes());
    let sum = checksum(&buf[..24]);
    buf[24..32].copy_from_slice(&sum.to_le_bytes());
    buf
}

/// What the state record says, before it is weighed against the boot.
enum Record {
    /// Never written (a new file).
    Empty,
    /// Written and intact.
    Valid {
        boot: [u8; 16],
        last_token: u64,
        slot: u32,
        holder: Option<Stamp>,
    },
    /// A keylock record whose checksum fails (torn by a crash).
    Torn,
    /// Not a keylock record, or a newer format.
    Foreign,
}

fn decode_state(buf: &[u8]) -> Record {
    if buf.iter().all(|&b| b == 0) {
        return Record::Empty;
    }
    if &buf[0..4] != STATE_MAGIC || u32_at(buf, 4) != VERSION {
        return Record::Foreign;
    }
    if checksum(&buf[..STATE_LEN - 8]) != u64_at(buf, STATE_LEN - 8) {
        return Record::Torn;
    }
    let flags = u32_at(buf, 8);
    let mut boot = [0u8; 16];
    boot.copy_from_slice(&buf[64..80]);
    let text = |len_at: usize, max: usize| {
        let len = usize::from(buf[len_at]).min(max);
        String::from_utf8_lossy(&buf[len_at + 1..len_at + 1 + len]).into_owned()
    };
    let holder = (flags & 1 != 0).then(|| {
        let lease = u64_at(buf, 32);
        Stamp {
            pid: u32_at(buf, 20),
            token: u64_at(buf, 24),
            lease_deadline: (flags & 2 != 0).then_some(lease),
            granted_mono: u64_at(buf, 40),
            granted_unix_ns: u64_at(buf, 48),
            host: text(80, MAX_HOST),
            label: (flags & 4 != 0).then(|| text(145, MAX_LABEL)),
        }
    });
    Record::Valid {
        boot,
        last_token: u64_at(buf, 12),
        slot: u32_at(buf, 56),
        holder,
    }
}

fn encode_state(state: &State) -> [u8; STATE_LEN] {
    let mut buf = [0u8; STATE_LEN];
    buf[0..4].copy_from_slice(STATE_MAGIC);
    buf[4..8].copy_from_slice(&VERSION.to_le_bytes());
    let mut flags = 0u32;
    buf[12..20].copy_from_slice(&state.last_token.to_le_bytes());
    buf[56..60].copy_from_slice(&state.slot.to_le_bytes());
    buf[64..80].copy_from_slice(&unix::boot_id());
    if let Some(h) = &state.holder {
        flags |= 1;
        buf[20..24].copy_from_slice(&h.pid.to_le_bytes());
        buf[24..32].copy_from_slice(&h.token.to_le_bytes());
        if let Some(deadline) = h.lease_deadline {
            flags |= 2;
            buf[32..40].copy_from_slice(&deadline.to_le_bytes());
        }
        buf[40..48].copy_from_slice(&h.granted_mono.to_le_bytes());
        buf[48..56].copy_from_slice(&h.granted_unix_ns.to_le_bytes());
        let mut put = |len_at: usize, max: usize, s: &str| {
            let mut len = s.len().min(max);
            while !s.is_char_boundary(len) {
                len -= 1;
            }
            #[allow(clippy::cast_possible_truncation)] // at most 255
            {
                buf[len_at] = len as u8;
            }
            buf[len_at + 1..len_at + 1 + len].copy_from_slice(&s.as_bytes()[..len]);
        };
        put(80, MAX_HOST, &h.host);
        if let Some(label) = &h.label {
            flags |= 4;
            put(145, MAX_LABEL, label);
        }
    }
    buf[8..12].copy_from_slice(&flags.to_le_bytes());
    let sum = checksum(&buf[..STATE_LEN - 8]);
    buf[STATE_LEN - 8..].copy_from_slice(&sum.to_le_bytes());
    buf
}

fn read_all(file: &File, path: &Path) -> Result<[u8; FILE_LEN], ProcessLockError> {
    let mut buf = [0u8; FILE_LEN];
    let mut read = 0;
    while read < FILE_LEN {
        match file.read_at(&mut buf[read..], read as u64) {
            Ok(0) => break, // a new or short file: the rest reads as zeros
            Ok(n) => read += n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(err) => return Err(ProcessLockError::io("read the state file", path, err)),
        }
    }
    Ok(buf)
}

impl State {
    /// Reads a key's state. The caller holds the key's kernel lock
    /// (exclusive to change it, shared to look).
    pub(crate) fn load(file: &File, path: &Path) -> Result<Self, ProcessLockError> {
        let buf = read_all(file, path)?;
        let reserves = RESERVE_AT.map(|at| decode_reserve(&buf[at..at + RESERVE_LEN]));
        let reserved = reserves.iter().flatten().copied().max().unwrap_or(0);
        // Overwrite the invalid record, else the lower one.
        let reserve_next = match reserves {
            [None, _] => 0,
            [_, None] => 1,
            [Some(a), Some(b)] => usize::from(b < a),
        };
        let fresh = Self {
            last_token: reserved,
            slot: 0,
            holder: None,
            reserved,
            reserve_next,
            released: 0,
        };
        match decode_state(&buf[..STATE_LEN]) {
            Record::Empty => {
                let rest_empty = buf[STATE_LEN..].iter().all(|&b| b == 0);
                if reserves.iter().all(Option::is_none) && !rest_empty {
                    return Err(ProcessLockError::Corrupt { path: path.into() });
                }
                Ok(fresh)
            }
            Record::Foreign => Err(ProcessLockError::Corrupt { path: path.into() }),
            // Torn by a crash: every token handed out is at most the
            // durable ceiling, and no holder survived.
            Record::Torn => Ok(fresh),
            Record::Valid {
                boot,
                last_token,
                slot,
                holder,
            } if slot < MAX_SLOTS => {
                if boot != unix::boot_id() {
                    // Written before a reboot: its holder is gone, its
                    // deadline meaningless, and tokens may have been handed
                    // out after it was last written (it is never synced); the
                    // ceiling covers them.
                    return Ok(fresh);
                }
                // Same boot: the page cache is the truth (the record may be
                // above a ceiling whose newest copy was torn, never below
                // a token handed out).
                Ok(Self {
                    last_token,
                    slot,
                    holder,
                    reserved,
                    reserve_next,
                    released: u64_at(&buf, cell_at(slot)),
                })
            }
            Record::Valid { .. } => Err(ProcessLockError::Corrupt { path: path.into() }),
        }
    }

    /// The stamp of the key's holder: `None` if there is none or it was
    /// released (its token is in its slot's release cell). A holder named
    /// here may be dead: its slot's kernel lock says.
    pub(crate) fn holding(&self) -> Option<&Stamp> {
        self.holder.as_ref().filter(|h| h.token != self.released)
    }

    /// Mints the next token, first making its ceiling durable if it passes
    /// the current one.
    pub(crate) fn mint(&mut self, file: &File, path: &Path) -> Result<u64, ProcessLockError> {
        let token = self
            .last_token
            .checked_add(1)
            .filter(|&t| t < u64::MAX - RESERVE_BLOCK)
            .ok_or_else(|| ProcessLockError::InvalidOptions {
                option: "token",
                reason: format!("the fencing tokens of `{}` are exhausted", path.display()),
            })?;
        if token > self.reserved {
            let ceiling = token + RESERVE_BLOCK;
            let at = RESERVE_AT[self.reserve_next];
            file.write_all_at(&encode_reserve(ceiling), at as u64)
                .and_then(|()| file.sync_data())
                .map_err(|err| ProcessLockError::io("reserve fencing tokens in", path, err))?;
            self.reserved = ceiling;
            self.reserve_next ^= 1;
        }
        self.last_token = token;
        Ok(token)
    }

    /// Writes the state record (not synced; see the module doc).
    pub(crate) fn store(&self, file: &File, path: &Path) -> Result<(), ProcessLockError> {
        file.write_all_at(&encode_state(self), 0)
            .map_err(|err| ProcessLockError::io("write the owner stamp to", path, err))
    }
}

/// Writes slot `slot`'s release cell: the holder of token `token`, which
/// holds that slot, lets the key go. Not under the state lock (see the
/// module doc).
pub(crate) fn write_released(
    file: &File,
    path: &Path,
    slot: u32,
    token: u64,
) -> Result<(), ProcessLockError> {
    file.write_all_at(&token.to_le_bytes(), cell_at(slot) as u64)
        .map_err(|err| ProcessLockError::io("write the release of", path, err))
}

/// Who holds a key, as its owner stamp says, judged at the moment of the
/// read ([`ProcessLockTable::holder`](super::ProcessLockTable::holder), and
/// in [`ProcessLockError::Timeout`] and
/// [`ProcessLockError::WouldBlock`]).
///
/// `alive` is the kernel's answer, not a guess from the pid: the holder is
/// alive while it still holds its kernel lock, which the kernel frees the
/// moment the process dies, whatever it died of. A pid may be reused; a
/// kernel lock is not inherited by the pid's next owner.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-holder-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// let table = keylock::ProcessLockTable::open(&dir)?.with_label("nightly-report");
/// let guard = table.try_lock("report")?;
/// let holder = table.holder(&"report")?.expect("held");
/// assert_eq!(holder.pid, std::process::id());
/// assert!(holder.alive);
/// assert_eq!(holder.token, guard.token());
/// assert_eq!(holder.label.as_deref(), Some("nightly-report"));
/// assert!(holder.to_string().contains("nightly-report"));
/// # drop(guard);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), keylock::ProcessLockError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProcessHolder {
    /// The holder's process id.
    pub pid: u32,
    /// Whether the holder still holds its kernel lock. `false`: it died (or
    /// its files were replaced); the next locker takes the key at once.
    pub alive: bool,
    /// The holder's fencing token.
    pub token: FencingToken,
    /// How long it has held the key.
    pub held_for: Duration,
    /// The time left on its lease: `None` without a lease, zero once it
    /// lapsed (the next waiter takes the key over).
    pub lease_left: Option<Duration>,
    /// When it was granted the key, on the wall clock.
    pub granted_at: SystemTime,
    /// The host it runs on.
    pub hostname: String,
    /// The label of its table, if it set one
    /// ([`ProcessLockTable::with_label`](super::ProcessLockTable::with_label)).
    pub label: Option<String>,
}

impl ProcessHolder {
    pub(crate) fn from_stamp(stamp: &Stamp, alive: bool, now_mono: u64) -> Option<Self> {
        Some(Self {
            pid: stamp.pid,
            alive,
            token: FencingToken::new(stamp.token)?,
            held_for: Duration::from_nanos(now_mono.saturating_sub(stamp.granted_mono)),
            lease_left: stamp
                .lease_deadline
                .map(|d| Duration::from_nanos(d.saturating_sub(now_mono))),
            granted_at: UNIX_EPOCH + Duration::from_nanos(stamp.granted_unix_ns),
            hostname: stamp.host.clone(),
            label: stamp.label.clone(),
        })
    }
}

impl fmt::Display for ProcessHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {}", self.pid)?;
        if !self.hostname.is_empty() {
            write!(f, " on {}", self.hostname)?;
        }
        if let Some(label) = &self.label {
            write!(f, " ({label:?})")?;
        }
        f.write_str(if self.alive {
            ", alive"
        } else {
            ", dead (its kernel lock is free)"
        })?;
        write!(f, ", token {}, held for {:?}", self.token, self.held_for)?;
        match self.lease_left {
            None => f.write_str(", no lease"),
            Some(left) if left.is_zero() => f.write_str(", lease lapsed"),
            Some(left) => write!(f, ", lease ends in {left:?}"),
        }
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

    fn stamp() -> Stamp {
        Stamp {
            pid: 42,
            token: 7,
            lease_deadline: Some(123),
            granted_mono: 100,
            granted_unix_ns: 5,
            host: "h".repeat(80),
            label: Some("é".repeat(200)),
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "reads the system (boot id, files): not under miri")]
    fn a_state_record_round_trips_with_long_text_cut_on_char_boundaries() {
        let state = State {
            last_token: 9,
            slot: 3,
            holder: Some(stamp()),
            ..State::default()
        };
        let Record::Valid {
            last_token,
            slot,
            holder,
            boot,
        } = decode_state(&encode_state(&state))
        else {
            panic!("not valid")
        };
        assert_eq!((last_token, slot, boot), (9, 3, unix::boot_id()));
        let holder = holder.unwrap();
        assert_eq!(holder.host.len(), MAX_HOST);
        assert_eq!(
            holder.label.as_ref().unwrap().len(),
            254,
            "127 two-byte chars"
        );
        assert_eq!(holder.lease_deadline, Some(123));
    }

    #[test]
    #[cfg_attr(miri, ignore = "reads the system (boot id, files): not under miri")]
    fn a_torn_record_is_detected() {
        let mut buf = encode_state(&State::default());
        buf[13] ^= 1;
        assert!(matches!(decode_state(&buf), Record::Torn));
        let mut r = encode_reserve(77);
        assert_eq!(decode_reserve(&r), Some(77));
        r[9] ^= 4;
        assert_eq!(decode_reserve(&r), None);
    }

    #[test]
    #[cfg_attr(miri, ignore = "reads the system (boot id, files): not under miri")]
    fn after_a_reboot_tokens_restart_above_the_durable_ceiling() {
        let dir = std::env::temp_dir().join(format!("keylock-stamp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let mut state = State::load(&file, &path).unwrap();
        for _ in 0..5 {
            state.mint(&file, &path).unwrap();
        }
        state.store(&file, &path).unwrap();
        assert_eq!(State::load(&file, &path).unwrap().last_token, 5);
        // Forge a record of another boot: its last token is not trusted.
        let mut buf = encode_state(&state);
        buf[64] ^= 0xFF;
        let sum = checksum(&buf[..STATE_LEN - 8]);
        buf[STATE_LEN - 8..].copy_from_slice(&sum.to_le_bytes());
        file.write_all_at(&buf, 0).unwrap();
        let after = State::load(&file, &path).unwrap();
        assert_eq!(after.last_token, 1 + RESERVE_BLOCK);
        assert!(after.holder.is_none());
        // A torn reservation falls back on the other one.
        let mut state = after;
        state.last_token = state.reserved; // pass the ceiling: a new one is written
        state.mint(&file, &path).unwrap();
        let higher = state.reserved;
        file.write_all_at(&[0xAA; 8], RESERVE_AT[1 - state.reserve_next] as u64 + 8)
            .unwrap();
        let torn = State::load(&file, &path).unwrap();
        assert!(torn.reserved < higher && torn.reserved > 0);
        // Garbage is refused, not reset.
        file.write_all_at(b"not a keylock file", 0).unwrap();
        assert!(matches!(
            State::load(&file, &path),
            Err(ProcessLockError::Corrupt { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
