//! The etcd v3 lock recipe: a waiter key per session under the key's
//! prefix, FIFO by create revision, each waiter woken by a current watch of
//! the deletions of the keys ahead of it.
//!
//! # Acquiring
//!
//! 1. **Enqueue.** `txn(if create_revision(me) == 0 then put(me, stamp,
//!    session lease) else get(me))`, where `me` is
//!    `<prefix>/<key>/<session lease id>`. The answer gives `me`'s create
//!    revision: the grant's fencing token. Sending it again after an
//!    ambiguous failure finds the key and returns the same revision, so the
//!    enqueue is idempotent (the in-process tier guarantees that this
//!    session has no other waiter key for the key).
//!    The same transaction reads the head of the queue (the oldest key under
//!    the prefix): if it is `me`, the key is ours with this one round trip,
//!    and steps 2 and 3 are skipped.
//! 2. **Watch, then read.** Open a watch of the deletions under the
//!    prefix from now, and once etcd says it is created, read the keys
//!    ahead of ours (`get(prefix, max_create_revision = mine - 1, keys
//!    only)`) in a transaction that compares our own key's create revision.
//!    None ahead: the key is ours. Our own key gone: not ours (below).
//! 3. **Wait for their deletion.** A deletion after the read is seen by the
//!    watch, one before it is absent from the read, and no key older than
//!    ours can appear later (new keys get newer revisions): when every key
//!    read is deleted the key is ours, with no further read, so a handoff
//!    costs the holder's delete and one watch event. The watch starts from
//!    "now", so etcd serves it as a current watch, sending each deletion as
//!    it commits. (A watch from a past revision, even the read's + 1 once
//!    anything else has been written, is "behind" and served by etcd's
//!    100 ms catch-up loop instead; that is what makes etcd's own lock API
//!    slow to hand over.) If the watch breaks, start again at 2. Every
//!    waiter of the key sees every deletion under its prefix, but with the
//!    in-process tier there is at most one waiter per process and key.
//!    Only deletions after the read's revision count (a watch "from now"
//!    on a member that applies later may start behind the read).
//!
//!    **Our own key gone.** The watch also reports the deletion of our own
//!    key (its lease revoked or expired, or another client), in revision
//!    order with the others: reported before the last key ahead goes, the
//!    wait ends without the key (`SessionLost` if the lease has ended,
//!    `WaiterKeyDeleted` if it lives), as etcd's `concurrency.Mutex`
//!    answers `ErrSessionExpired`; not reported, our key existed when the
//!    last key ahead was deleted, and the key is ours.
//! 4. **Granted.** A waiter granted after waiting restamps its key (the
//!    host's wall clock, for diagnosis) with a put that compares the create
//!    revision and keeps the lease, not waited for; for a grant with a lease
//!    of its own, such a put (waited for) moves the key onto that lease (a
//!    put keeps a key's create revision, so the token stands).
//!
//! # Readers
//!
//! A shared grant's waiter key is `<prefix>/<key>/r-<lease id>-<n>`, one
//! per grant; writers' names (16 hex digits) sort before every reader's, so
//! `[<prefix>/<key>/, <prefix>/<key>/g)` is the key's writers. A reader's
//! enqueue reads that range (empty: the key is ours), and a waiting reader
//! waits only for the writers older than it; a writer waits for every older
//! key. So a writer waiting behind readers blocks the readers after it.
//!
//! # Releasing
//!
//! `txn(if create_revision(me) == token then delete(me))`, retried while
//! the lease that carries the key is believed valid. The in-process grant
//! is let go only after, so that the next caller of this process never
//! finds the old key.
//!
//! A release (or the undo of a failed acquisition) that gives up without
//! etcd's answer may leave its waiter key behind, and "not believed valid"
//! is not "ended": a keep-alive sent before the session's bound may be
//! answered after it, so the lease lives on in etcd with the key (the
//! session is then lost, but its lease is not known to be gone). So a delete that could not be confirmed retires the session
//! that names the key: it is marked lost, which stops its keep-alives and
//! revokes its lease (retried while etcd cannot be reached), and the key goes with
//! the lease; the next lock starts a new session, whose waiter keys have
//! other names, so an enqueue never finds a leftover key of an earlier
//! grant and never grants its create revision (its fencing token) again.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::client::{Enqueued, Range};
use super::error::{ClusterHolder, ClusterLockError};
use super::key;
use super::now;
use super::retry::retry;
use super::session::{Session, SessionState};
use super::table::Inner;
use crate::{FencingToken, Mode};

/// The lease that carries a grant's waiter key.
#[derive(Debug)]
pub(crate) enum GrantLease {
    /// The session's: kept alive with the session.
    Session(Arc<Session>),
    /// The grant's own (`LockOptions::lease`): not kept alive, renewed by
    /// hand.
    Own {
        id: i64,
        ttl: Duration,
        valid_until: Mutex<Instant>,
    },
}

impl GrantLease {
    pub(crate) fn id(&self) -> i64 {
        match self {
            Self::Session(s) => s.state.lease_id,
            Self::Own { id, .. } => *id,
        }
    }

    /// Before this instant etcd cannot have ended the lease.
    pub(crate) fn valid_until(&self) -> Instant {
        match self {
            Self::Session(s) => s.state.valid_until(),
            Self::Own { valid_until, .. } => {
                *valid_until.lock().unwrap_or_else(PoisonError::into_inner)
            }
        }
    }

    /// The TTL etcd granted the lease with.
    pub(crate) fn ttl(&self) -> Duration {
        match self {
            Self::Session(s) => s.state.ttl,
            Self::Own { ttl, .. } => *ttl,
        }
    }

    pub(crate) fn is_live(&self) -> bool {
        match self {
            Self::Session(s) => s.state.is_live(),
            Self::Own { .. } => now() < self.valid_until(),
        }
    }
}

/// A key taken in etcd.
#[derive(Debug)]
pub(crate) struct Grant {
    pub(crate) waiter_key: String,
    pub(crate) revision: i64,
    pub(crate) token: FencingToken,
    pub(crate) lease: GrantLease,
    /// The session whose lease id names the waiter key (also for a grant
    /// with a lease of its own): retired if the key's delete cannot be
    /// confirmed, so that no later enqueue of it finds the key.
    pub(crate) session: Arc<SessionState>,
}

/// Why a session is retired when a waiter key's delete was not confirmed.
const UNCONFIRMED_DELETE: &str = "a waiter key's delete could not be confirmed: the session's \
     lease is revoked so that the key goes with it";

/// What a failed or cancelled acquisition must undo: the waiter key it may
/// have written (named before it is sent, so that an enqueue cut short is
/// undone too) and the lease of its own it may have been granted.
#[derive(Debug, Default)]
pub(crate) struct Undo {
    waiter_key: Mutex<Option<String>>,
    own_lease: Mutex<Option<i64>>,
}

impl Undo {
    /// Deletes the waiter key (whoever wrote it: this session has no other
    /// for the key while the in-process grant is held) and revokes the
    /// lease of its own, retrying while the session lives. A delete that
    /// could not be confirmed retires the session (see the module
    /// documentation).
    pub(crate) async fn run(&self, inner: &Inner, session: Option<&Session>) {
        let key = self
            .waiter_key
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(key) = key {
            let bound = session.map(|s| s.state.valid_until());
            let deleted = retry("delete the waiter key", &inner.counts, bound, || {
                inner.etcd.delete(&key)
            })
            .await;
            if let (Err(_), Some(session)) = (deleted, session) {
                session.state.mark_lost(UNCONFIRMED_DELETE.into());
            }
            inner.etcd_waiters.fetch_sub(1, Ordering::Relaxed);
        }
        let own = self
            .own_lease
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(id) = own {
            let bound = Some(now() + Duration::from_secs(5));
            let _ = retry("revoke the grant's lease", &inner.counts, bound, || {
                inner.etcd.lease_revoke(id)
            })
            .await;
        }
    }
}

/// How a wait for the predecessor ended.
enum Wake {
    /// Every waiter key ahead is gone: the key is ours.
    Granted,
    /// The watch broke or was cancelled: read again.
    Again,
    /// The caller's deadline passed.
    Deadline,
    /// The session ended.
    SessionEnded,
    /// Our own waiter key is gone (its lease was revoked or expired, or
    /// another client deleted it): the key is not ours, whatever was
    /// deleted ahead of it.
    Gone,
}

/// The whole acquisition in etcd; on an error the caller runs `undo`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn acquire(
    inner: &Inner,
    session: &Arc<Session>,
    stem: &str,
    mode: Mode,
    own_lease: Option<Duration>,
    deadline: Option<Instant>,
    wait: bool,
    started: Instant,
    undo: &Undo,
) -> Result<Grant, ClusterLockError> {
    if !session.state.is_live() {
        return Err(session.state.lost_error());
    }
    let prefix = key::key_prefix(&inner.prefix, stem);
    let shared = mode == Mode::Shared;
    let me = if shared {
        let n = inner.readers.fetch_add(1, Ordering::Relaxed);
        key::reader_key(&prefix, session.state.lease_id, n)
    } else {
        key::waiter_key(&prefix, session.state.lease_id)
    };
    let lease_id = session.state.lease_id;
    // `since` now: right if the key is ours at once (the uncontended case,
    // which then needs no second write); a waiter restamps when it gets it.
    let stamp = key::stamp(inner.label.as_deref(), true);
    // The deadline of the etcd calls: the caller's, or for a try_lock one
    // TTL (the session is lost by then anyway if etcd cannot be reached).
    let call_bound = deadline.or_else(|| Some(now() + session.state.ttl));

    // 1. Enqueue.
    *undo
        .waiter_key
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Some(me.clone());
    inner.etcd_waiters.fetch_add(1, Ordering::Relaxed);
    // A writer: the head of the queue, as of this put; if it is ours, the
    // key is ours with this one round trip. A reader: any writer (all are
    // older than this put); if there is none, the key is ours.
    let head_range = if shared {
        Range::Writers(prefix.clone())
    } else {
        Range::All(prefix.clone())
    };
    let enqueued = retry("enqueue the waiter key", &inner.counts, call_bound, || {
        inner.etcd.enqueue(&me, &stamp, lease_id, &head_range)
    })
    .await
    .map_err(|e| lease_gone(session, e))?;
    let (revision, at_once) = match enqueued {
        Enqueued::Created { revision, oldest } => {
            let at_once = if shared {
                oldest.is_none()
            } else {
                oldest.as_deref() == Some(me.as_str())
            };
            (revision, at_once)
        }
        Enqueued::Existing { create_revision } => (create_revision, false),
    };
    let token = u64::try_from(revision)
        .ok()
        .and_then(FencingToken::new)
        .ok_or_else(|| ClusterLockError::InvalidOptions {
            option: "waiter key",
            reason: format!("etcd answered the enqueue with revision {revision}"),
        })?;

    // 2 and 3. Wait for every waiter key ahead to go.
    loop {
        if at_once {
            break;
        }
        if !wait {
            let range = ahead_of(&prefix, shared);
            let ahead = retry("read the waiters ahead", &inner.counts, call_bound, || {
                inner.etcd.read_ahead(&me, revision, &range)
            })
            .await?;
            match ahead {
                None => return Err(waiter_key_gone(inner, session, &me).await),
                Some((keys, _)) if keys.is_empty() => break,
                Some(_) => {}
            }
            let (holder, _) = head(inner, &prefix, revision).await;
            return Err(ClusterLockError::WouldBlock {
                holder: holder.map(Box::new),
                key: key::name(stem),
            });
        }
        match wait_turn(inner, session, &me, &prefix, revision, shared, deadline).await {
            Wake::Granted => break,
            Wake::Again => {}
            Wake::Deadline => {
                let (holder, ahead) = head(inner, &prefix, revision).await;
                return Err(ClusterLockError::Timeout {
                    waited: now().saturating_duration_since(started),
                    holder: holder.map(Box::new),
                    ahead,
                    key: key::name(stem),
                });
            }
            Wake::SessionEnded => return Err(session.state.lost_error()),
            Wake::Gone => return Err(waiter_key_gone(inner, session, &me).await),
        }
    }

    // 4. Granted: stamp it (and move it onto its own lease, if asked).
    let held_stamp = key::stamp(inner.label.as_deref(), true);
    let lease = match own_lease {
        None if at_once => GrantLease::Session(Arc::clone(session)),
        None => {
            let etcd = Arc::clone(&inner.etcd);
            let key = me.clone();
            // Diagnosis only: not waited for.
            drop(inner.handle.spawn(async move {
                let _ = etcd.put_if(&key, revision, &held_stamp, None).await;
            }));
            GrantLease::Session(Arc::clone(session))
        }
        Some(ttl) => {
            let secs = i64::try_from(ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0))
                .unwrap_or(i64::MAX)
                .max(1);
            let sent = now();
            let (own_id, granted_ttl) =
                retry("grant the grant's lease", &inner.counts, call_bound, || {
                    inner.etcd.lease_grant(secs)
                })
                .await?;
            *undo
                .own_lease
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(own_id);
            let moved = retry(
                "move the key onto its lease",
                &inner.counts,
                call_bound,
                || inner.etcd.put_if(&me, revision, &held_stamp, Some(own_id)),
            )
            .await?;
            if !moved {
                return Err(waiter_key_gone(inner, session, &me).await);
            }
            let ttl = Duration::from_secs(u64::try_from(granted_ttl).unwrap_or(1));
            GrantLease::Own {
                id: own_id,
                ttl,
                valid_until: Mutex::new(sent + ttl),
            }
        }
    };
    // The grant owns the key now: nothing to undo.
    undo.waiter_key
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    undo.own_lease
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    Ok(Grant {
        waiter_key: me,
        revision,
        token,
        lease,
        session: Arc::clone(&session.state),
    })
}

/// The range of the waiter keys that we wait for (those older than ours
/// in it): all of them for a writer, the writers' for a reader.
fn ahead_of(prefix: &str, shared: bool) -> Range {
    if shared {
        Range::Writers(prefix.to_owned())
    } else {
        Range::All(prefix.to_owned())
    }
}

/// An enqueue that etcd refused because the session's lease no longer
/// exists (revoked, or expired while the keep-alives had not noticed yet):
/// the session is lost.
fn lease_gone(session: &Session, err: ClusterLockError) -> ClusterLockError {
    match &err {
        ClusterLockError::Etcd { source, .. } | ClusterLockError::Unavailable { source, .. }
            if super::retry::lease_not_found(source) =>
        {
            session
                .state
                .mark_lost("etcd says the session's lease no longer exists".into());
            session.state.lost_error()
        }
        _ => err,
    }
}

/// What to answer when our own waiter key is gone before the key was ours
/// (as etcd's `concurrency.Mutex` re-reads its key after waiting and
/// answers `ErrSessionExpired`): if the lease that carried it has ended
/// (revoked or expired) the session is lost, and the waiters behind us
/// take the key; if the lease lives, another client deleted the key.
async fn waiter_key_gone(inner: &Inner, session: &Session, me: &str) -> ClusterLockError {
    let id = session.state.lease_id;
    let ttl = tokio::time::timeout(inner.request_timeout, inner.etcd.lease_time_to_live(id)).await;
    match ttl {
        Ok(Ok(ttl)) if ttl > 0 => ClusterLockError::WaiterKeyDeleted { key: me.to_owned() },
        // Gone, or etcd cannot say: the session cannot vouch for its keys.
        _ => {
            session.state.mark_lost(
                "etcd deleted a waiter key of the session: its lease was revoked or expired".into(),
            );
            session.state.lost_error()
        }
    }
}

/// Waits until every waiter key older than ours is deleted: opens a watch
/// of the deletions under the prefix *first* (from now: etcd serves it as
/// a current watch, woken as each deletion commits), then reads the keys
/// ahead. A deletion after the read is seen by the watch; one before it is
/// absent from the read; and no key older than ours can appear later (new
/// keys get newer revisions). So when every key read is deleted, the key is
/// ours, with no further read.
///
/// Unless our own key went first: the read checks that it is there (in the
/// same transaction), and the watch, which sees every deletion under the
/// prefix in revision order, reports its deletion before (or with) any
/// deletion that comes after it. So when the last key ahead is deleted and
/// no deletion of ours was reported, our key existed at that revision: the
/// grant is decided on etcd's order, with no round trip more.
#[allow(clippy::too_many_arguments)]
async fn wait_turn(
    inner: &Inner,
    session: &Session,
    me: &str,
    prefix: &str,
    revision: i64,
    shared: bool,
    deadline: Option<Instant>,
) -> Wake {
    let turn = async {
        let mut stream = inner.etcd.watch_deletes(prefix).await?;
        // The watch is in place once etcd says it is created.
        match stream.message().await? {
            Some(resp) if resp.created && !resp.canceled => {}
            _ => return Ok(Wake::Again),
        }
        let range = ahead_of(prefix, shared);
        let Some((ahead, read_rev)) = inner.etcd.read_ahead(me, revision, &range).await? else {
            return Ok(Wake::Gone);
        };
        let mut ahead: HashSet<Vec<u8>> = ahead.into_iter().collect();
        // The watch may have started behind the read (its member applies
        // later than the one that answered the read): a deletion it reports
        // at or before the read's revision is already in the read, and may
        // be of an older key of the same name (a table reuses its waiter
        // key's name for its next grant). Only deletions after the read
        // count.
        while !ahead.is_empty() {
            let Some(resp) = stream.message().await? else {
                return Ok(Wake::Again);
            };
            if resp.canceled {
                return Ok(Wake::Again);
            }
            for (key, deleted_at) in &resp.deleted {
                if *deleted_at > read_rev {
                    if key.as_slice() == me.as_bytes() {
                        return Ok(Wake::Gone);
                    }
                    ahead.remove(key);
                }
            }
        }
        Ok::<Wake, etcd_client::Error>(Wake::Granted)
    };
    let far = now() + Duration::from_secs(86_400 * 365);
    let until = tokio::time::Instant::from_std(deadline.unwrap_or(far));
    tokio::select! {
        // In this order (not at random), so that a run is reproducible.
        biased;
        r = turn => match r {
            Ok(wake) => wake,
            Err(err) => {
                // The stream or the read broke (a member died, a leader
                // changed): start again, after a short pause so that a dead
                // member is not hammered.
                match super::retry::classify(&err) {
                    super::retry::Failure::Refused => {
                        inner.counts.refused.fetch_add(1, Ordering::Relaxed)
                    }
                    _ => inner.counts.ambiguous.fetch_add(1, Ordering::Relaxed),
                };
                tokio::time::sleep(Duration::from_millis(20)).await;
                Wake::Again
            }
        },
        () = tokio::time::sleep_until(until) => Wake::Deadline,
        () = session.state.ended() => Wake::SessionEnded,
    }
}

/// The key's holder (the oldest waiter key) and how many waiter keys are
/// older than `revision` (all of them if it is 0); for a diagnosis, so
/// failures answer `None` and 0.
pub(crate) async fn head(
    inner: &Inner,
    prefix: &str,
    revision: i64,
) -> (Option<ClusterHolder>, usize) {
    let limit = Duration::from_secs(2);
    let holder = match tokio::time::timeout(limit, inner.etcd.oldest(prefix)).await {
        Ok(Ok(first)) => first.as_ref().and_then(super::client::Entry::holder),
        _ => None,
    };
    let ahead = match tokio::time::timeout(limit, inner.etcd.count_older(prefix, revision)).await {
        Ok(Ok(n)) => n,
        _ => 0,
    };
    (holder, ahead)
}

/// Deletes a grant's waiter key (if it still is that grant's) and revokes
/// its own lease, retrying while the lease that carries the key is believed
/// valid. A delete that could not be confirmed retires the grant's session
/// (marked lost: its keep-alives stop and its lease is revoked), so that
/// the key goes with the lease and no later enqueue finds it; see the
/// module documentation.
pub(crate) async fn release(inner: &Inner, grant: &Grant) -> Result<(), ClusterLockError> {
    let mut result;
    loop {
        let bound = grant.lease.valid_until();
        result = retry("delete the waiter key", &inner.counts, Some(bound), || {
            inner.etcd.delete_if(&grant.waiter_key, grant.revision)
        })
        .await
        .map(drop);
        match &result {
            // Unanswered until the bound, but the bound moved (a keep-alive
            // was answered meanwhile): try again.
            Err(ClusterLockError::Unavailable { .. }) if grant.lease.is_live() => {}
            _ => break,
        }
    }
    if result.is_err() {
        grant.session.mark_lost(UNCONFIRMED_DELETE.into());
    }
    if let GrantLease::Own { id, .. } = &grant.lease {
        let id = *id;
        let bound = Some(now() + Duration::from_secs(5));
        let _ = retry("revoke the grant's lease", &inner.counts, bound, || {
            inner.etcd.lease_revoke(id)
        })
        .await;
    }
    inner.etcd_waiters.fetch_sub(1, Ordering::Relaxed);
    result
}
