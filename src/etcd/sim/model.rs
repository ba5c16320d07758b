//! An in-process model of etcd's KV, lease, watch and transaction
//! semantics, behind the client seam ([`Etcd`]), on tokio's (paused) clock,
//! with seeded faults between each client and the store.
//!
//! What it models: one linearizable store (a revision counter; keys with
//! create and mod revisions and a lease; a delete bumps the revision, a
//! lease's revoke deletes all its keys at one revision); leases that
//! expire at simulated time (checked every 100 ms while the cluster has a
//! leader) and whose TTL every leader change resets (etcd issue #9395);
//! watches of deletions from now, delivered per watcher in revision order;
//! three members, each client attached to one (a member down refuses its
//! calls and cuts its streams; the client moves to another, as the
//! balancer does); per client: message delay, loss of a request (not
//! applied) or of an answer (applied), a partition (calls time out after
//! the request timeout), a pause (nothing of the process runs), a crash
//! (nothing of it ever reaches the store again).
//!
//! Not modelled: Raft itself (members' logs, a follower that applies late,
//! a watch that starts behind a read), compaction, auth, request sizes,
//! etcd's minimum TTL, the 500 ms granularity of etcd's lessor, clock
//! drift between hosts.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::super::client::{
    Call, DeleteWatch, Enqueued, Entry, Etcd, KeepAlive, Range, WatchMessage,
};
use super::super::now;
use super::Rng;

const MEMBERS: usize = 3;

fn refused() -> etcd_client::Error {
    etcd_client::Error::IoError(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "connection refused",
    ))
}

fn timed_out() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::deadline_exceeded(
        "context deadline exceeded",
    ))
}

fn leader_changed() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::unavailable("etcdserver: leader changed"))
}

fn lease_not_found() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::not_found(
        "etcdserver: requested lease not found",
    ))
}

#[derive(Debug, Clone)]
struct Kv {
    value: Vec<u8>,
    create_revision: i64,
    lease: i64,
}

#[derive(Debug)]
struct Lease {
    /// The client that was granted it.
    owner: usize,
    ttl: i64,
    expires: Instant,
    keys: BTreeSet<String>,
}

enum WatchItem {
    Deleted(Vec<(Vec<u8>, i64)>),
    Canceled,
}

struct Watcher {
    client: usize,
    prefix: String,
    tx: mpsc::UnboundedSender<WatchItem>,
}

/// One client's link to the cluster.
#[derive(Debug, Default, Clone)]
struct Link {
    member: usize,
    /// Bumped when the client's streams are cut.
    epoch: u64,
    partitioned_until: Option<Instant>,
    paused_until: Option<Instant>,
    /// Every pause's length, summed.
    paused_for: Duration,
    crashed: bool,
    /// Extra delay each way, and until when.
    slow: Option<(Instant, Duration)>,
    /// Probability (per mille) that a request, or an answer, is lost, and
    /// until when.
    loss: Option<(Instant, u32, u32)>,
}

/// A fenced write the store accepted: the history the checks read.
#[derive(Debug, Clone)]
pub(crate) struct DataWrite {
    pub(crate) revision: i64,
    pub(crate) key: String,
    pub(crate) token: i64,
    pub(crate) value: i64,
    pub(crate) client: usize,
}

/// The store and the network.
pub(crate) struct State {
    rng: Rng,
    revision: i64,
    kv: BTreeMap<String, Kv>,
    leases: BTreeMap<i64, Lease>,
    next_lease: i64,
    watchers: Vec<Watcher>,
    up: bool,
    members_up: [bool; MEMBERS],
    /// Calls arriving before this instant meet a leader change.
    electing_until: Option<Instant>,
    links: Vec<Link>,
    request_timeout: Duration,
    pub(crate) writes: Vec<DataWrite>,
    /// Store events per lock key (its stem), the last few, for traces.
    pub(crate) trace: BTreeMap<String, VecDeque<String>>,
}

impl State {
    fn note(&mut self, key: &str, what: String) {
        let stem = key
            .strip_prefix("sim/")
            .and_then(|k| k.split('/').next())
            .unwrap_or(key)
            .to_owned();
        let t = super::sim_ms();
        let q = self.trace.entry(stem).or_default();
        if q.len() == 4096 {
            q.pop_front();
        }
        q.push_back(format!("{t:>9} ms  store   {what}"));
    }

    fn notify(&mut self, deleted: &[(String, i64)]) {
        for w in &self.watchers {
            let batch: Vec<(Vec<u8>, i64)> = deleted
                .iter()
                .filter(|(k, _)| k.starts_with(&w.prefix))
                .map(|(k, r)| (k.as_bytes().to_vec(), *r))
                .collect();
            if !batch.is_empty() {
                let _ = w.tx.send(WatchItem::Deleted(batch));
            }
        }
    }

    fn detach(&mut self, key: &str, lease: i64) {
        if let Some(l) = self.leases.get_mut(&lease) {
            l.keys.remove(key);
        }
    }

    fn put(
        &mut self,
        key: &str,
        value: &[u8],
        lease: Option<i64>,
    ) -> Result<i64, etcd_client::Error> {
        if let Some(id) = lease.filter(|id| *id != 0) {
            if !self.leases.contains_key(&id) {
                return Err(lease_not_found());
            }
        }
        self.revision += 1;
        let rev = self.revision;
        let old = self.kv.get(key).cloned();
        let lease = lease.unwrap_or_else(|| old.as_ref().map_or(0, |o| o.lease));
        if let Some(o) = &old {
            if o.lease != lease {
                self.detach(key, o.lease);
            }
        }
        if let Some(l) = self.leases.get_mut(&lease) {
            l.keys.insert(key.to_owned());
        }
        self.kv.insert(
            key.to_owned(),
            Kv {
                value: value.to_vec(),
                create_revision: old.as_ref().map_or(rev, |o| o.create_revision),
                lease,
            },
        );
        Ok(rev)
    }

    fn delete(&mut self, key: &str, why: &str) -> bool {
        let Some(old) = self.kv.remove(key) else {
            return false;
        };
        self.revision += 1;
        let rev = self.revision;
        self.detach(key, old.lease);
        self.note(
            key,
            format!("rev {rev}: {why} {key} (created {})", old.create_revision),
        );
        self.notify(&[(key.to_owned(), rev)]);
        true
    }

    fn revoke(&mut self, id: i64, why: &str) -> bool {
        let Some(lease) = self.leases.remove(&id) else {
            return false;
        };
        if lease.keys.is_empty() {
            return true;
        }
        self.revision += 1;
        let rev = self.revision;
        let mut deleted = Vec::new();
        for key in lease.keys {
            if let Some(old) = self.kv.remove(&key) {
                self.note(
                    &key,
                    format!(
                        "rev {rev}: lease {id:x} {why}: {key} (created {})",
                        old.create_revision
                    ),
                );
                deleted.push((key, rev));
            }
        }
        self.notify(&deleted);
        true
    }

    fn in_range<'a>(&'a self, range: &'a Range) -> impl Iterator<Item = (&'a String, &'a Kv)> + 'a {
        self.kv
            .range(range.prefix().to_owned()..)
            .take_while(move |(k, _)| k.starts_with(range.prefix()))
            .filter(move |(k, _)| range.contains(k))
    }

    fn oldest_in(&self, range: &Range) -> Option<(String, Kv)> {
        self.in_range(range)
            .min_by_key(|(_, kv)| kv.create_revision)
            .map(|(k, kv)| (k.clone(), kv.clone()))
    }

    fn created(&self, key: &str) -> i64 {
        self.kv.get(key).map_or(0, |kv| kv.create_revision)
    }
}

/// The simulated cluster: the store, the network, the faults.
pub(crate) struct Cluster {
    state: Mutex<State>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").finish_non_exhaustive()
    }
}

enum Reach {
    Ok,
    Refused,
    BlackHole,
    Dead,
}

impl Cluster {
    pub(crate) fn new(seed: u64, request_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                rng: Rng::new(seed ^ 0x005E_ED0F_E7CD),
                revision: 1,
                kv: BTreeMap::new(),
                leases: BTreeMap::new(),
                next_lease: 0x1000,
                watchers: Vec::new(),
                up: true,
                members_up: [true; MEMBERS],
                electing_until: None,
                links: Vec::new(),
                request_timeout,
                writes: Vec::new(),
                trace: BTreeMap::new(),
            }),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new client (a process): its link.
    pub(crate) fn connect(self: &Arc<Self>) -> Client {
        let mut st = self.lock();
        let id = st.links.len();
        let member = id % MEMBERS;
        st.links.push(Link {
            member,
            ..Link::default()
        });
        Client {
            cluster: Arc::clone(self),
            id,
        }
    }

    /// Expires the leases whose TTL ran out (while there is a leader).
    pub(crate) fn tick(&self) {
        let mut st = self.lock();
        st.watchers.retain(|w| !w.tx.is_closed());
        if !st.up {
            return;
        }
        let t = now();
        let due: Vec<i64> = st
            .leases
            .iter()
            .filter(|(_, l)| l.expires <= t)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            st.revoke(id, "expired");
        }
    }

    // ------------------------------------------------------------ faults

    fn cut(st: &mut State, client: usize) {
        st.links[client].epoch += 1;
        st.watchers.retain(|w| w.client != client);
    }

    pub(crate) fn partition(&self, client: usize, d: Duration) {
        let mut st = self.lock();
        st.links[client].partitioned_until = Some(now() + d);
        Self::cut(&mut st, client);
    }

    pub(crate) fn pause(&self, client: usize, d: Duration) {
        let mut st = self.lock();
        st.links[client].paused_until = Some(now() + d);
        st.links[client].paused_for += d;
    }

    /// How long the client has been paused in all, so far.
    pub(crate) fn paused_for(&self, client: usize) -> Duration {
        self.lock().links[client].paused_for
    }

    pub(crate) fn paused_until(&self, client: usize) -> Option<Instant> {
        self.lock().links[client]
            .paused_until
            .filter(|u| *u > now())
    }

    pub(crate) fn crash(&self, client: usize) {
        let mut st = self.lock();
        st.links[client].crashed = true;
        Self::cut(&mut st, client);
    }

    pub(crate) fn slow(&self, client: usize, extra: Duration, d: Duration) {
        self.lock().links[client].slow = Some((now() + d, extra));
    }

    pub(crate) fn lossy(&self, client: usize, request: u32, answer: u32, d: Duration) {
        self.lock().links[client].loss = Some((now() + d, request, answer));
    }

    pub(crate) fn member_down(&self, member: usize) {
        let mut st = self.lock();
        st.members_up[member] = false;
        for c in 0..st.links.len() {
            if st.links[c].member == member {
                Self::cut(&mut st, c);
            }
        }
    }

    pub(crate) fn member_up(&self, member: usize) {
        self.lock().members_up[member] = true;
    }

    /// A new leader: every lease's TTL starts again (etcd issue #9395),
    /// and the calls in flight meet the change.
    pub(crate) fn leader_change(&self) {
        let mut st = self.lock();
        let t = now();
        for l in st.leases.values_mut() {
            l.expires = t + Duration::from_secs(u64::try_from(l.ttl).unwrap_or(1));
        }
        st.electing_until = Some(t + Duration::from_millis(300));
    }

    /// Every member down: no leader, no expiry, every stream cut.
    pub(crate) fn outage(&self) {
        let mut st = self.lock();
        st.up = false;
        for c in 0..st.links.len() {
            Self::cut(&mut st, c);
        }
    }

    /// The cluster back, with a new leader.
    pub(crate) fn recover(&self) {
        self.lock().up = true;
        self.leader_change();
    }

    /// Revokes, as an operator would, the lease of a waiter that is not
    /// the head of its queue, if there is one: the lease id.
    pub(crate) fn revoke_a_waiter(&self, pick: u64) -> Option<i64> {
        let mut st = self.lock();
        // Keys with two waiters or more: revoke a non-head waiter's lease.
        let mut queues: BTreeMap<String, Vec<(i64, i64)>> = BTreeMap::new();
        for (k, kv) in &st.kv {
            if let Some(stem) = k.strip_prefix("sim/").and_then(|k| k.split('/').next()) {
                if kv.lease != 0 {
                    queues
                        .entry(stem.to_owned())
                        .or_default()
                        .push((kv.create_revision, kv.lease));
                }
            }
        }
        let mut choices: Vec<i64> = Vec::new();
        for q in queues.values_mut() {
            q.sort_unstable();
            choices.extend(q.iter().skip(1).map(|(_, l)| *l));
        }
        // Not a holder's: its check() is judged locally and cannot see a
        // revoke before its next keep-alive (the store's fence refuses its
        // writes at once).
        if choices.is_empty() {
            return None;
        }
        let id = choices[usize::try_from(pick % choices.len() as u64).unwrap_or(0)];
        if st.up {
            st.revoke(id, "revoked by an operator");
        }
        Some(id)
    }

    /// The server cancels one client's watches.
    pub(crate) fn cancel_watches(&self, client: usize) {
        let mut st = self.lock();
        for w in st.watchers.iter().filter(|w| w.client == client) {
            let _ = w.tx.send(WatchItem::Canceled);
        }
        st.watchers.retain(|w| w.client != client);
    }

    /// Heals every fault of the network (not crashes, nor the cluster).
    pub(crate) fn heal(&self) {
        let mut st = self.lock();
        for l in &mut st.links {
            l.partitioned_until = None;
            l.paused_until = None;
            l.slow = None;
            l.loss = None;
        }
        st.members_up = [true; MEMBERS];
    }

    /// The waiter keys in the store: (key, create revision, lease, the
    /// client the lease was granted to).
    pub(crate) fn waiter_keys(&self) -> Vec<(String, i64, i64, Option<usize>)> {
        let st = self.lock();
        st.kv
            .iter()
            .filter(|(k, _)| k.starts_with("sim/"))
            .map(|(k, kv)| {
                let owner = st.leases.get(&kv.lease).map(|l| l.owner);
                (k.clone(), kv.create_revision, kv.lease, owner)
            })
            .collect()
    }

    /// Whether the client crashed.
    pub(crate) fn crashed(&self, client: usize) -> bool {
        self.lock().links[client].crashed
    }

    pub(crate) fn revision(&self) -> i64 {
        self.lock().revision
    }

    fn reach(&self, client: usize) -> Reach {
        let mut st = self.lock();
        let t = now();
        let up = st.up;
        let members_up = st.members_up;
        let link = &mut st.links[client];
        if link.crashed {
            return Reach::Dead;
        }
        if link.partitioned_until.is_some_and(|u| t < u) {
            return Reach::BlackHole;
        }
        if !up {
            return Reach::Refused;
        }
        if !members_up[link.member] {
            // The balancer tries another member next time.
            link.member = (link.member + 1) % MEMBERS;
            return Reach::Refused;
        }
        Reach::Ok
    }
}

/// One client's view of the cluster: the seam's implementation.
#[derive(Debug, Clone)]
pub(crate) struct Client {
    cluster: Arc<Cluster>,
    pub(crate) id: usize,
}

enum Lost {
    No,
    Request,
    Answer,
}

impl Client {
    pub(crate) fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// Waits while the process is paused.
    pub(crate) async fn unpaused(&self) {
        while let Some(until) = self.cluster.paused_until(self.id) {
            tokio::time::sleep_until(until.into()).await;
        }
    }

    fn draw(&self) -> (Duration, Duration, Lost, u64) {
        let mut st = self.cluster.lock();
        let t = now();
        let link = st.links[self.id].clone();
        let extra = link
            .slow
            .filter(|(u, _)| t < *u)
            .map_or(Duration::ZERO, |(_, e)| e);
        let (req, ans) = link
            .loss
            .filter(|(u, _, _)| t < *u)
            .map_or((0, 0), |(_, r, a)| (r, a));
        let rng = &mut st.rng;
        let there = Duration::from_micros(500 + rng.below(4_500)) + extra;
        let back = Duration::from_micros(500 + rng.below(4_500)) + extra;
        let roll = rng.below(1000);
        let lost = if roll < u64::from(req) {
            Lost::Request
        } else if roll < u64::from(req + ans) {
            Lost::Answer
        } else {
            Lost::No
        };
        let coin = rng.next();
        (there, back, lost, coin)
    }

    /// One request: to the store and back through the client's link,
    /// `apply` run on the store when it arrives.
    async fn call<T>(
        &self,
        apply: impl FnOnce(&mut State) -> Result<T, etcd_client::Error>,
    ) -> Result<T, etcd_client::Error> {
        self.unpaused().await;
        let timeout = self.cluster.lock().request_timeout;
        let began = now();
        let give_up = || tokio::time::sleep_until((began + timeout).into());
        match self.cluster.reach(self.id) {
            Reach::Ok => {}
            Reach::Dead => std::future::pending().await,
            Reach::Refused => {
                tokio::time::sleep(Duration::from_millis(1)).await;
                return Err(refused());
            }
            Reach::BlackHole => {
                give_up().await;
                return Err(timed_out());
            }
        }
        let (there, back, lost, coin) = self.draw();
        tokio::time::sleep(there).await;
        if matches!(lost, Lost::Request) {
            give_up().await;
            return Err(timed_out());
        }
        // On arrival: the cluster may have gone meanwhile.
        match self.cluster.reach(self.id) {
            Reach::Ok => {}
            Reach::Dead => std::future::pending().await,
            Reach::Refused | Reach::BlackHole => {
                give_up().await;
                return Err(timed_out());
            }
        }
        let answer = {
            let mut st = self.cluster.lock();
            let electing = st.electing_until.is_some_and(|u| now() < u);
            if electing && coin % 2 == 0 {
                Err(leader_changed())
            } else {
                let r = apply(&mut st);
                if electing {
                    // Applied, but the answer is lost in the change.
                    Err(leader_changed())
                } else {
                    r
                }
            }
        };
        tokio::time::sleep(back).await;
        if matches!(lost, Lost::Answer) {
            give_up().await;
            return Err(timed_out());
        }
        if self.cluster.lock().links[self.id].crashed {
            std::future::pending::<()>().await;
        }
        self.unpaused().await;
        answer
    }

    fn epoch(&self) -> u64 {
        self.cluster.lock().links[self.id].epoch
    }

    /// The application's fenced read of its data key:
    /// `txn(if create_revision(fence) == token then get(data))`.
    pub(crate) async fn fenced_get(
        &self,
        fence: &str,
        token: i64,
        data: &str,
    ) -> Result<Option<i64>, etcd_client::Error> {
        self.call(|st| {
            if st.created(fence) != token {
                return Ok(None);
            }
            Ok(Some(st.kv.get(data).map_or(0, |kv| {
                String::from_utf8_lossy(&kv.value).parse().unwrap_or(0)
            })))
        })
        .await
    }

    /// The application's fenced write: `txn(if create_revision(fence) ==
    /// token then put(data, value))`: whether it was applied.
    pub(crate) async fn fenced_put(
        &self,
        fence: &str,
        token: i64,
        data: &str,
        value: i64,
    ) -> Result<bool, etcd_client::Error> {
        let client = self.id;
        self.call(move |st| {
            if st.created(fence) != token {
                return Ok(false);
            }
            let rev = st.put(data, value.to_string().as_bytes(), None)?;
            st.writes.push(DataWrite {
                revision: rev,
                key: data.to_owned(),
                token,
                value,
                client,
            });
            Ok(true)
        })
        .await
    }
}

struct ModelWatch {
    client: Client,
    created: bool,
    rx: mpsc::UnboundedReceiver<WatchItem>,
}

impl DeleteWatch for ModelWatch {
    fn message(&mut self) -> Call<'_, Option<WatchMessage>> {
        Box::pin(async move {
            if !self.created {
                self.created = true;
                return Ok(Some(WatchMessage {
                    created: true,
                    ..WatchMessage::default()
                }));
            }
            let item = self.rx.recv().await;
            let (_, back, _, _) = self.client.draw();
            tokio::time::sleep(back).await;
            if self.client.cluster.lock().links[self.client.id].crashed {
                std::future::pending::<()>().await;
            }
            self.client.unpaused().await;
            match item {
                Some(WatchItem::Deleted(deleted)) => Ok(Some(WatchMessage {
                    deleted,
                    ..WatchMessage::default()
                })),
                Some(WatchItem::Canceled) => Ok(Some(WatchMessage {
                    canceled: true,
                    ..WatchMessage::default()
                })),
                None => Err(etcd_client::Error::WatchError(
                    "the watch stream was cut".into(),
                )),
            }
        })
    }
}

struct ModelKeepAlive {
    client: Client,
    id: i64,
    epoch: u64,
    tx: mpsc::UnboundedSender<Result<i64, etcd_client::Error>>,
    rx: mpsc::UnboundedReceiver<Result<i64, etcd_client::Error>>,
}

impl KeepAlive for ModelKeepAlive {
    fn keep_alive(&mut self) -> Call<'_, ()> {
        Box::pin(async move {
            if self.client.epoch() != self.epoch {
                return Err(etcd_client::Error::LeaseKeepAliveError(
                    "the keep-alive stream was cut".into(),
                ));
            }
            let client = self.client.clone();
            let tx = self.tx.clone();
            let id = self.id;
            // Sent on the stream: the answer comes (or not) on its own.
            drop(tokio::spawn(async move {
                let answer = client
                    .call(|st| {
                        let t = now();
                        Ok(match st.leases.get_mut(&id) {
                            Some(l) => {
                                l.expires =
                                    t + Duration::from_secs(u64::try_from(l.ttl).unwrap_or(1));
                                l.ttl
                            }
                            None => 0,
                        })
                    })
                    .await;
                // A failed call on a stream is an answer never received.
                if let Ok(ttl) = answer {
                    let _ = tx.send(Ok(ttl));
                }
            }));
            Ok(())
        })
    }

    fn message(&mut self) -> Call<'_, Option<i64>> {
        Box::pin(async move {
            match self.rx.recv().await {
                Some(r) => r.map(Some),
                None => Ok(None),
            }
        })
    }
}

impl Etcd for Client {
    fn enqueue<'a>(
        &'a self,
        me: &'a str,
        value: &'a str,
        lease: i64,
        head: &'a Range,
    ) -> Call<'a, Enqueued> {
        Box::pin(self.call(move |st| {
            if st.created(me) == 0 {
                let revision = st.put(me, value.as_bytes(), Some(lease))?;
                st.note(me, format!("rev {revision}: enqueued {me}"));
                let oldest = st.oldest_in(head).map(|(k, _)| k);
                Ok(Enqueued::Created { revision, oldest })
            } else {
                Ok(Enqueued::Existing {
                    create_revision: st.created(me),
                })
            }
        }))
    }

    fn read_ahead<'a>(
        &'a self,
        me: &'a str,
        revision: i64,
        ahead: &'a Range,
    ) -> Call<'a, Option<(Vec<Vec<u8>>, i64)>> {
        Box::pin(self.call(move |st| {
            if st.created(me) != revision {
                return Ok(None);
            }
            let keys = st
                .in_range(ahead)
                .filter(|(_, kv)| kv.create_revision < revision)
                .map(|(k, _)| k.as_bytes().to_vec())
                .collect();
            Ok(Some((keys, st.revision)))
        }))
    }

    fn put_if<'a>(
        &'a self,
        me: &'a str,
        revision: i64,
        value: &'a str,
        lease: Option<i64>,
    ) -> Call<'a, bool> {
        Box::pin(self.call(move |st| {
            if st.created(me) != revision {
                return Ok(false);
            }
            st.put(me, value.as_bytes(), lease)?;
            Ok(true)
        }))
    }

    fn delete_if<'a>(&'a self, me: &'a str, revision: i64) -> Call<'a, bool> {
        Box::pin(self.call(move |st| {
            if st.created(me) != revision {
                return Ok(false);
            }
            Ok(st.delete(me, "released"))
        }))
    }

    fn delete<'a>(&'a self, key: &'a str) -> Call<'a, ()> {
        Box::pin(self.call(move |st| {
            st.delete(key, "undone");
            Ok(())
        }))
    }

    fn oldest<'a>(&'a self, prefix: &'a str) -> Call<'a, Option<Entry>> {
        Box::pin(self.call(move |st| {
            Ok(st
                .oldest_in(&Range::All(prefix.to_owned()))
                .map(|(key, kv)| Entry {
                    key,
                    value: kv.value,
                    create_revision: kv.create_revision,
                    lease: kv.lease,
                }))
        }))
    }

    fn count_older<'a>(&'a self, prefix: &'a str, revision: i64) -> Call<'a, usize> {
        Box::pin(self.call(move |st| {
            Ok(st
                .in_range(&Range::All(prefix.to_owned()))
                .filter(|(_, kv)| revision == 0 || kv.create_revision < revision)
                .count())
        }))
    }

    fn lease_grant(&self, ttl: i64) -> Call<'_, (i64, i64)> {
        let owner = self.id;
        Box::pin(self.call(move |st| {
            st.next_lease += 1 + i64::try_from(st.rng.below(16)).unwrap_or(0);
            let id = st.next_lease;
            st.leases.insert(
                id,
                Lease {
                    owner,
                    ttl,
                    expires: now() + Duration::from_secs(u64::try_from(ttl).unwrap_or(1)),
                    keys: BTreeSet::new(),
                },
            );
            Ok((id, ttl))
        }))
    }

    fn lease_revoke(&self, id: i64) -> Call<'_, ()> {
        Box::pin(self.call(move |st| {
            if st.revoke(id, "revoked") {
                Ok(())
            } else {
                Err(lease_not_found())
            }
        }))
    }

    fn lease_time_to_live(&self, id: i64) -> Call<'_, i64> {
        Box::pin(self.call(move |st| {
            let t = now();
            Ok(st.leases.get(&id).map_or(-1, |l| {
                i64::try_from(l.expires.saturating_duration_since(t).as_secs()).unwrap_or(0)
            }))
        }))
    }

    fn lease_keep_alive(&self, id: i64) -> Call<'_, Box<dyn KeepAlive>> {
        Box::pin(async move {
            self.call(|_| Ok(())).await?;
            let (tx, rx) = mpsc::unbounded_channel();
            Ok(Box::new(ModelKeepAlive {
                client: self.clone(),
                id,
                epoch: self.epoch(),
                tx,
                rx,
            }) as Box<dyn KeepAlive>)
        })
    }

    fn watch_deletes<'a>(&'a self, prefix: &'a str) -> Call<'a, Box<dyn DeleteWatch>> {
        Box::pin(async move {
            let (tx, rx) = mpsc::unbounded_channel();
            let client = self.id;
            self.call(move |st| {
                st.watchers.push(Watcher {
                    client,
                    prefix: prefix.to_owned(),
                    tx,
                });
                Ok(())
            })
            .await?;
            Ok(Box::new(ModelWatch {
                client: self.clone(),
                created: false,
                rx,
            }) as Box<dyn DeleteWatch>)
        })
    }
}
