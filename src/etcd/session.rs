//! The session: one etcd lease per table, kept alive by a task, and judged
//! locally.
//!
//! Every waiter key of the table is attached to the session's lease (but
//! those of grants with a lease of their own), so a process that dies,
//! however it dies, frees its keys when the lease's TTL runs out, and a
//! process cut from the cluster loses them the same way.
//!
//! # Judged locally
//!
//! The session knows a time before which etcd cannot have expired the
//! lease: the instant a keep-alive was *sent* plus the TTL its answer
//! granted (etcd starts the TTL when it receives the request, later). A
//! guard's `check()` compares the monotonic clock with that bound, with no
//! round trip. When keep-alives fail the bound is not moved, so guards are
//! fenced at the bound at the latest, before etcd can hand the key to
//! anyone else; when etcd answers that the lease is gone (TTL 0), or the
//! table revokes it, the session is marked lost at once.
//!
//! # Lost is final
//!
//! Once the bound has passed, no keep-alive is sent again: one would renew
//! in etcd a lease whose guards were told they lost their keys. A lost (or
//! closed) session stops its keep-alives and revokes its lease, retrying
//! while etcd cannot be reached, so that its waiter keys (those whose
//! deletes gave up during an outage included) vanish as soon as etcd
//! answers again.
//!
//! A keep-alive answered after the bound passed (sent before it) does not
//! move the bound back: the session is lost then too, although its lease
//! lived on in etcd, since `check()` may already have failed. And a bound
//! that has passed is not yet an ended lease, so a release (or an undo)
//! that gives up on its delete does not count on the lease ending: it
//! marks the session lost itself (see `recipe.rs`, "Releasing"), and the
//! key goes with the revoked lease.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::client::Etcd;
use super::error::ClusterLockError;
use super::now;
use super::retry::{classify, Failure};

/// The state a session shares with its keep-alive task.
#[derive(Debug)]
pub(crate) struct SessionState {
    pub(crate) lease_id: i64,
    pub(crate) ttl: Duration,
    /// Before this instant etcd cannot have expired the lease.
    valid_until: Mutex<Instant>,
    lost: AtomicBool,
    lost_reason: Mutex<Option<String>>,
    /// Flips to `true` once when the session is lost (waiters watch it).
    lost_tx: tokio::sync::watch::Sender<bool>,
}

impl SessionState {
    pub(crate) fn valid_until(&self) -> Instant {
        *self
            .valid_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the lease is certainly alive now: not lost, within the bound.
    pub(crate) fn is_live(&self) -> bool {
        !self.lost.load(Ordering::Acquire) && now() < self.valid_until()
    }

    /// Moves the bound to `sent + ttl`, unless it had passed when the
    /// keep-alive was sent or by the time its answer came: a renewal never
    /// revives (guards may have been told they lost their keys), so the
    /// session is lost instead, and its lease revoked.
    fn extend(&self, sent: Instant, ttl_secs: i64) {
        let ttl = Duration::from_secs(u64::try_from(ttl_secs).unwrap_or(0));
        let mut v = self
            .valid_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if sent >= *v || now() >= *v {
            drop(v);
            self.mark_lost("keep-alives failed past the lease's TTL".into());
            return;
        }
        *v = (*v).max(sent + ttl);
    }

    pub(crate) fn mark_lost(&self, reason: String) {
        if !self.lost.swap(true, Ordering::AcqRel) {
            *self
                .lost_reason
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(reason);
            self.lost_tx.send_replace(true);
        }
    }

    /// The error that says why the session is not live.
    pub(crate) fn lost_error(&self) -> ClusterLockError {
        let reason = self
            .lost_reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .unwrap_or_else(|| "keep-alives failed past the lease's TTL".to_owned());
        ClusterLockError::SessionLost {
            lease_id: self.lease_id,
            reason,
        }
    }

    /// A receiver that sees the session marked lost (its value turns
    /// `true`), for a guard's loss watcher.
    pub(crate) fn lost_receiver(&self) -> tokio::sync::watch::Receiver<bool> {
        self.lost_tx.subscribe()
    }

    /// Resolves when the session is marked lost (not at its bound).
    async fn lost_flag(&self) {
        let mut rx = self.lost_tx.subscribe();
        while !*rx.borrow_and_update() {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// Resolves when the session is lost, or at its validity bound.
    pub(crate) async fn ended(&self) {
        let mut rx = self.lost_tx.subscribe();
        loop {
            if *rx.borrow_and_update() {
                return;
            }
            let until = self.valid_until();
            if now() >= until {
                return;
            }
            tokio::select! {
                biased;
                _ = rx.changed() => {}
                () = tokio::time::sleep_until(until.into()) => {}
            }
        }
    }
}

/// A session: the lease and its keep-alive task. Dropped with the last
/// table or guard using it: the task stops renewing and revokes the lease
/// (its remaining keys vanish at once).
pub(crate) struct Session {
    pub(crate) state: Arc<SessionState>,
    etcd: Arc<dyn Etcd>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Grants a lease of `ttl` (whole seconds, rounded up; the options
    /// bound it) and starts keeping it alive; retries until `deadline`.
    pub(crate) async fn start(
        etcd: &Arc<dyn Etcd>,
        handle: &tokio::runtime::Handle,
        ttl: Duration,
        counts: &super::retry::RetryCounts,
        deadline: Instant,
    ) -> Result<Self, ClusterLockError> {
        let whole = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let secs = i64::try_from(whole.max(1)).unwrap_or(i64::MAX);
        let sent = now();
        let (lease_id, granted_ttl) =
            super::retry::retry("grant the session lease", counts, Some(deadline), || {
                etcd.lease_grant(secs)
            })
            .await?;
        let (lost_tx, _) = tokio::sync::watch::channel(false);
        let state = Arc::new(SessionState {
            lease_id,
            ttl: Duration::from_secs(u64::try_from(granted_ttl).unwrap_or(1)),
            valid_until: Mutex::new(sent),
            lost: AtomicBool::new(false),
            lost_reason: Mutex::new(None),
            lost_tx,
        });
        *state
            .valid_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = sent + state.ttl;
        drop(handle.spawn(keep_alive(Arc::clone(etcd), Arc::clone(&state))));
        Ok(Self {
            state,
            etcd: Arc::clone(etcd),
        })
    }

    /// Sends one keep-alive now and waits for its answer: the bound moves
    /// to now + TTL. Fails if the lease is gone or etcd cannot be reached
    /// before the bound.
    pub(crate) async fn refresh(&self) -> Result<(), ClusterLockError> {
        if !self.state.is_live() {
            return Err(self.state.lost_error());
        }
        let deadline = self.state.valid_until();
        let id = self.state.lease_id;
        let counts = super::retry::RetryCounts::seeded(id.unsigned_abs());
        let sent = now();
        let ttl = super::retry::retry("renew the session lease", &counts, Some(deadline), || {
            let etcd = &self.etcd;
            async move {
                let mut stream = etcd.lease_keep_alive(id).await?;
                stream.keep_alive().await?;
                match stream.message().await? {
                    Some(ttl) => Ok(ttl),
                    None => Err(etcd_client::Error::LeaseKeepAliveError(
                        "the keep-alive stream ended".into(),
                    )),
                }
            }
        })
        .await;
        match ttl {
            Ok(ttl) if ttl > 0 => {
                self.state.extend(sent, ttl);
                Ok(())
            }
            Ok(_) => {
                self.state.mark_lost("etcd says the lease expired".into());
                Err(self.state.lost_error())
            }
            Err(
                ClusterLockError::Etcd { source, .. }
                | ClusterLockError::Unavailable { source, .. },
            ) if super::retry::lease_not_found(&source) => {
                self.state.mark_lost("etcd says the lease expired".into());
                Err(self.state.lost_error())
            }
            Err(e) => Err(e),
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // The keep-alive task sees the session lost, stops renewing and
        // revokes the lease (its remaining keys vanish at once), retrying
        // while etcd cannot be reached. If the runtime is gone, the keys go
        // with the lease's TTL.
        self.state.mark_lost("the session was closed".into());
    }
}

/// How long a lost or closed session keeps trying to revoke its lease
/// while etcd cannot be reached. Past it etcd ends the lease on its own,
/// one TTL after it is back (the keep-alives have stopped).
const REVOKE_FOR: Duration = Duration::from_secs(600);

/// The session's task: keeps the lease alive while the session lives,
/// then (lost, or closed) stops renewing it and revokes it, so that its
/// waiter keys, those whose deletes failed included, vanish as soon as
/// etcd can be reached, not when a lease that something kept alive ends.
async fn keep_alive(etcd: Arc<dyn Etcd>, state: Arc<SessionState>) {
    let gone = tokio::select! {
        biased;
        gone = renew(&*etcd, &state) => gone,
        () = state.lost_flag() => false,
    };
    if !gone {
        revoke(&*etcd, &state).await;
    }
}

/// Revokes a lost session's lease, retrying (backoff up to 1 s) for
/// [`REVOKE_FOR`] until etcd answers, whatever the answer.
async fn revoke(etcd: &dyn Etcd, state: &SessionState) {
    let give_up = now() + REVOKE_FOR;
    let mut backoff = Duration::from_millis(20);
    loop {
        match etcd.lease_revoke(state.lease_id).await {
            Ok(_) => return,
            // Not found (already ended), or refused for good.
            Err(err) if classify(&err) == Failure::Fatal => return,
            Err(_) => {}
        }
        if now() + backoff >= give_up {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// The keep-alive loop: a keep-alive every third of the TTL on one stream,
/// re-established when it breaks. While etcd cannot be reached the bound
/// stays where it was, so guards fence themselves at it; once it has
/// passed, no keep-alive is sent again (one would renew, in etcd, a lease
/// whose guards were told they lost their keys): the session is lost.
/// Returns `true` if etcd said the lease is gone, `false` once the session
/// is lost otherwise.
async fn renew(etcd: &dyn Etcd, state: &SessionState) -> bool {
    let period = (state.ttl / 3).max(Duration::from_millis(100));
    // The grant itself set the bound: the first keep-alive is due one
    // period after it, as every later one.
    tokio::time::sleep(period).await;
    let mut backoff = Duration::from_millis(20);
    let past_bound = || {
        if state.is_live() {
            return false;
        }
        state.mark_lost("keep-alives failed past the lease's TTL".into());
        true
    };
    'stream: loop {
        if past_bound() {
            return false;
        }
        let opened = tokio::time::timeout(period, etcd.lease_keep_alive(state.lease_id)).await;
        let mut stream = match opened {
            Ok(Ok(stream)) => stream,
            Ok(Err(err)) => {
                if super::retry::lease_not_found(&err) {
                    state.mark_lost(format!("etcd refused the keep-alive: {err}"));
                    return true;
                }
                if classify(&err) == Failure::Fatal {
                    state.mark_lost(format!("etcd refused the keep-alive: {err}"));
                    return false;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(period);
                continue 'stream;
            }
            Err(_) => continue 'stream,
        };
        loop {
            let sent = now();
            if past_bound() {
                return false;
            }
            if stream.keep_alive().await.is_err() {
                continue 'stream;
            }
            match tokio::time::timeout(period, stream.message()).await {
                Ok(Ok(Some(ttl))) => {
                    if ttl <= 0 {
                        state.mark_lost("etcd says the lease expired".into());
                        return true;
                    }
                    state.extend(sent, ttl);
                    if state.lost.load(Ordering::Acquire) {
                        return false;
                    }
                    backoff = Duration::from_millis(20);
                }
                // Cut, ended or slow: open a new stream (to another member,
                // if the balancer picks one).
                _ => continue 'stream,
            }
            tokio::time::sleep_until((sent + period).into()).await;
        }
    }
}
