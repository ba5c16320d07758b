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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::error::ClusterLockError;
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
        !self.lost.load(Ordering::Acquire) && Instant::now() < self.valid_until()
    }

    /// Moves the bound to `sent + ttl`, unless it had passed when the
    /// keep-alive was sent: a renewal never revives (guards may have been
    /// told they lost their keys), so the session is lost instead.
    fn extend(&self, sent: Instant, ttl_secs: i64) {
        let ttl = Duration::from_secs(u64::try_from(ttl_secs).unwrap_or(0));
        let mut v = self
            .valid_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if sent >= *v {
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

    /// Resolves when the session is lost, or at its validity bound.
    pub(crate) async fn ended(&self) {
        let mut rx = self.lost_tx.subscribe();
        loop {
            if *rx.borrow_and_update() {
                return;
            }
            let until = self.valid_until();
            if Instant::now() >= until {
                return;
            }
            tokio::select! {
                _ = rx.changed() => {}
                () = tokio::time::sleep_until(until.into()) => {}
            }
        }
    }
}

/// A session: the lease, its keep-alive task, and the runtime it runs on.
/// Dropped with the last table or guard using it: the task stops and the
/// lease is revoked (its remaining keys vanish at once).
pub(crate) struct Session {
    pub(crate) state: Arc<SessionState>,
    task: tokio::task::JoinHandle<()>,
    client: etcd_client::Client,
    handle: tokio::runtime::Handle,
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
        client: &etcd_client::Client,
        handle: &tokio::runtime::Handle,
        ttl: Duration,
        counts: &super::retry::RetryCounts,
        deadline: Instant,
    ) -> Result<Self, ClusterLockError> {
        let whole = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let secs = i64::try_from(whole.max(1)).unwrap_or(i64::MAX);
        let sent = Instant::now();
        let granted =
            super::retry::retry("grant the session lease", counts, Some(deadline), || {
                let mut c = client.clone();
                async move { c.lease_grant(secs, None).await }
            })
            .await?;
        let (lost_tx, _) = tokio::sync::watch::channel(false);
        let state = Arc::new(SessionState {
            lease_id: granted.id(),
            ttl: Duration::from_secs(u64::try_from(granted.ttl()).unwrap_or(1)),
            valid_until: Mutex::new(sent),
            lost: AtomicBool::new(false),
            lost_reason: Mutex::new(None),
            lost_tx,
        });
        *state
            .valid_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = sent + state.ttl;
        let task = handle.spawn(keep_alive(client.clone(), Arc::clone(&state)));
        Ok(Self {
            state,
            task,
            client: client.clone(),
            handle: handle.clone(),
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
        let counts = super::retry::RetryCounts::default();
        let sent = Instant::now();
        let ttl = super::retry::retry("renew the session lease", &counts, Some(deadline), || {
            let mut c = self.client.clone();
            async move {
                let (mut keeper, mut stream) = c.lease_keep_alive(id).await?;
                keeper.keep_alive().await?;
                match stream.message().await? {
                    Some(resp) => Ok(resp.ttl()),
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
        self.task.abort();
        self.state.mark_lost("the session was closed".into());
        let mut client = self.client.clone();
        let id = self.state.lease_id;
        // Fire and forget: if it fails, the lease's TTL frees the keys.
        drop(self.handle.spawn(async move {
            let _ = client.lease_revoke(id).await;
        }));
    }
}

/// The keep-alive loop: a keep-alive every third of the TTL on one stream,
/// re-established when it breaks; the session is lost when etcd says the
/// lease is gone. While etcd cannot be reached the bound stays where it
/// was, so guards fence themselves at it.
async fn keep_alive(client: etcd_client::Client, state: Arc<SessionState>) {
    let period = (state.ttl / 3).max(Duration::from_millis(100));
    let mut backoff = Duration::from_millis(20);
    'stream: loop {
        let mut c = client.clone();
        let opened = tokio::time::timeout(period, c.lease_keep_alive(state.lease_id)).await;
        let (mut keeper, mut stream) = match opened {
            Ok(Ok(pair)) => pair,
            Ok(Err(err)) => {
                if classify(&err) == Failure::Fatal
                    || matches!(&err, etcd_client::Error::LeaseKeepAliveError(m) if m.contains("not found"))
                {
                    state.mark_lost(format!("etcd refused the keep-alive: {err}"));
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(period);
                continue 'stream;
            }
            Err(_) => continue 'stream,
        };
        loop {
            let sent = Instant::now();
            if keeper.keep_alive().await.is_err() {
                continue 'stream;
            }
            match tokio::time::timeout(period, stream.message()).await {
                Ok(Ok(Some(resp))) => {
                    if resp.ttl() <= 0 {
                        state.mark_lost("etcd says the lease expired".into());
                        return;
                    }
                    state.extend(sent, resp.ttl());
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
