//! The client seam: the etcd calls the recipe and the session make, in
//! their own terms ([`Etcd`]), and their implementation on `etcd-client`
//! ([`EtcdClient`]).
//!
//! Each method is one etcd request (a transaction, a range read, a lease
//! call) or one stream (a watch of deletions, a lease keep-alive stream),
//! answered with the few fields the recipe reads. Failures are
//! `etcd_client::Error`s, classified by `retry.rs` as refused, ambiguous or
//! fatal; an implementation reports each fault as etcd-client would (a
//! lease that etcd no longer has is a gRPC `NotFound` "requested lease not
//! found", a timed-out call a `DeadlineExceeded`, a leader change an
//! `Unavailable`).
//!
//! Production tables talk to etcd through [`EtcdClient`]; the crate's
//! deterministic simulation of the cluster scope (its tests) runs the same
//! recipe, session and table against a model of etcd behind this trait.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, WatchFilterType, WatchOptions,
};

use super::error::ClusterHolder;
use super::key;

/// A boxed, sendable future of a seam call.
pub(crate) type Call<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, etcd_client::Error>> + Send + 'a>>;

/// A range of waiter keys under a key's prefix (with its trailing `/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Range {
    /// Every waiter key of the key.
    All(String),
    /// The writers' waiter keys: `[prefix, prefix + "g")`.
    Writers(String),
}

impl Range {
    /// The prefix the range lies under.
    pub(crate) fn prefix(&self) -> &str {
        match self {
            Self::All(p) | Self::Writers(p) => p,
        }
    }

    /// Whether `key` lies in the range.
    #[cfg(test)]
    pub(crate) fn contains(&self, key: &str) -> bool {
        match self {
            Self::All(p) => key.starts_with(p.as_str()),
            Self::Writers(p) => key.starts_with(p.as_str()) && key < key::writers_end(p).as_str(),
        }
    }

    fn options(&self) -> GetOptions {
        match self {
            Self::All(_) => GetOptions::new().with_prefix(),
            Self::Writers(p) => GetOptions::new().with_range(key::writers_end(p)),
        }
    }
}

/// A key's entry, as the recipe reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) key: String,
    pub(crate) value: Vec<u8>,
    pub(crate) create_revision: i64,
    pub(crate) lease: i64,
}

impl Entry {
    /// The holder this entry names (for diagnosis).
    pub(crate) fn holder(&self) -> Option<ClusterHolder> {
        key::holder_of(self.create_revision, self.lease, &self.value)
    }
}

/// The answer to an enqueue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Enqueued {
    /// The waiter key was written at `revision` (its create revision);
    /// `oldest` is the oldest key of the head range as of that write (its
    /// name), if any.
    Created {
        revision: i64,
        oldest: Option<String>,
    },
    /// The waiter key existed already, with this create revision (0 if the
    /// answer had no entry).
    Existing { create_revision: i64 },
}

/// One message of a watch of deletions.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct WatchMessage {
    /// etcd says the watch is in place.
    pub(crate) created: bool,
    /// etcd cancelled the watch.
    pub(crate) canceled: bool,
    /// The deletions, in revision order: each key and its deletion's
    /// revision.
    pub(crate) deleted: Vec<(Vec<u8>, i64)>,
}

/// A watch of the deletions under a prefix.
pub(crate) trait DeleteWatch: Send {
    /// The next message; `Ok(None)` when the stream ended.
    fn message(&mut self) -> Call<'_, Option<WatchMessage>>;
}

/// A lease keep-alive stream.
pub(crate) trait KeepAlive: Send {
    /// Sends one keep-alive.
    fn keep_alive(&mut self) -> Call<'_, ()>;
    /// The next answer's TTL, in seconds (0 or less: the lease is gone);
    /// `Ok(None)` when the stream ended.
    fn message(&mut self) -> Call<'_, Option<i64>>;
}

/// The etcd calls of the cluster scope. See the [module documentation](self).
pub(crate) trait Etcd: Send + Sync + fmt::Debug {
    /// `txn(if create_revision(me) == 0 then put(me, value, lease) and
    /// get(oldest key of head) else get(me))`.
    fn enqueue<'a>(
        &'a self,
        me: &'a str,
        value: &'a str,
        lease: i64,
        head: &'a Range,
    ) -> Call<'a, Enqueued>;

    /// `txn(if create_revision(me) == revision then get(keys of ahead
    /// created before revision))`: `None` if our own key is not there (with
    /// that revision), else the names of the keys ahead and the revision of
    /// the read.
    fn read_ahead<'a>(
        &'a self,
        me: &'a str,
        revision: i64,
        ahead: &'a Range,
    ) -> Call<'a, Option<(Vec<Vec<u8>>, i64)>>;

    /// `txn(if create_revision(me) == revision then put(me, value))`, the
    /// key kept on its lease (`lease` `None`) or moved onto `lease`:
    /// whether it was done.
    fn put_if<'a>(
        &'a self,
        me: &'a str,
        revision: i64,
        value: &'a str,
        lease: Option<i64>,
    ) -> Call<'a, bool>;

    /// `txn(if create_revision(me) == revision then delete(me))`: whether it
    /// was done.
    fn delete_if<'a>(&'a self, me: &'a str, revision: i64) -> Call<'a, bool>;

    /// `delete(key)`.
    fn delete<'a>(&'a self, key: &'a str) -> Call<'a, ()>;

    /// The oldest key (by create revision) under `prefix`, with its value.
    fn oldest<'a>(&'a self, prefix: &'a str) -> Call<'a, Option<Entry>>;

    /// How many keys under `prefix` were created before `revision` (all of
    /// them if it is 0).
    fn count_older<'a>(&'a self, prefix: &'a str, revision: i64) -> Call<'a, usize>;

    /// Grants a lease of `ttl` seconds: its id and the TTL etcd gave it.
    fn lease_grant(&self, ttl: i64) -> Call<'_, (i64, i64)>;

    /// Revokes a lease (its keys are deleted).
    fn lease_revoke(&self, id: i64) -> Call<'_, ()>;

    /// The remaining TTL of a lease, in seconds (0 or less: gone).
    fn lease_time_to_live(&self, id: i64) -> Call<'_, i64>;

    /// Opens a keep-alive stream of a lease.
    fn lease_keep_alive(&self, id: i64) -> Call<'_, Box<dyn KeepAlive>>;

    /// Opens a watch of the deletions under `prefix`, from now.
    fn watch_deletes<'a>(&'a self, prefix: &'a str) -> Call<'a, Box<dyn DeleteWatch>>;
}

/// The seam on `etcd-client`: each call is the etcd request the recipe
/// describes.
#[derive(Clone)]
pub(crate) struct EtcdClient(pub(crate) etcd_client::Client);

impl fmt::Debug for EtcdClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdClient").finish_non_exhaustive()
    }
}

fn revision_of(header: Option<&etcd_client::ResponseHeader>) -> i64 {
    header.map_or(0, etcd_client::ResponseHeader::revision)
}

fn gets(resp: &etcd_client::TxnResponse) -> Vec<etcd_client::GetResponse> {
    resp.op_responses()
        .into_iter()
        .filter_map(|r| match r {
            TxnOpResponse::Get(g) => Some(g),
            _ => None,
        })
        .collect()
}

fn if_created(me: &str, revision: i64) -> Compare {
    Compare::create_revision(me.to_owned(), CompareOp::Equal, revision)
}

struct ClientWatch(etcd_client::WatchStream);

impl DeleteWatch for ClientWatch {
    fn message(&mut self) -> Call<'_, Option<WatchMessage>> {
        Box::pin(async move {
            let Some(resp) = self.0.message().await? else {
                return Ok(None);
            };
            let deleted = resp
                .events()
                .iter()
                .filter(|e| e.event_type() == EventType::Delete)
                .filter_map(|e| e.kv().map(|kv| (kv.key().to_vec(), kv.mod_revision())))
                .collect();
            Ok(Some(WatchMessage {
                created: resp.created(),
                canceled: resp.canceled(),
                deleted,
            }))
        })
    }
}

struct ClientKeepAlive(etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream);

impl KeepAlive for ClientKeepAlive {
    fn keep_alive(&mut self) -> Call<'_, ()> {
        Box::pin(self.0.keep_alive())
    }

    fn message(&mut self) -> Call<'_, Option<i64>> {
        Box::pin(async move { Ok(self.1.message().await?.map(|r| r.ttl())) })
    }
}

impl Etcd for EtcdClient {
    fn enqueue<'a>(
        &'a self,
        me: &'a str,
        value: &'a str,
        lease: i64,
        head: &'a Range,
    ) -> Call<'a, Enqueued> {
        let mut c = self.0.clone();
        Box::pin(async move {
            // A writer: the head of the queue, as of this put; a reader:
            // any writer (all are older than this put).
            let head_opts = match head {
                Range::All(_) => head
                    .options()
                    .with_sort(SortTarget::Create, SortOrder::Ascend),
                Range::Writers(_) => head.options(),
            }
            .with_limit(1)
            .with_keys_only();
            let txn = Txn::new()
                .when([if_created(me, 0)])
                .and_then([
                    TxnOp::put(me, value, Some(PutOptions::new().with_lease(lease))),
                    TxnOp::get(head.prefix(), Some(head_opts)),
                ])
                .or_else([TxnOp::get(me, None)]);
            let resp = c.txn(txn).await?;
            let first = gets(&resp)
                .iter()
                .find_map(|g| g.kvs().first())
                .map(|kv| (kv.key().to_vec(), kv.create_revision()));
            Ok(if resp.succeeded() {
                Enqueued::Created {
                    revision: revision_of(resp.header()),
                    oldest: first.map(|(k, _)| String::from_utf8_lossy(&k).into_owned()),
                }
            } else {
                Enqueued::Existing {
                    create_revision: first.map_or(0, |(_, r)| r),
                }
            })
        })
    }

    fn read_ahead<'a>(
        &'a self,
        me: &'a str,
        revision: i64,
        ahead: &'a Range,
    ) -> Call<'a, Option<(Vec<Vec<u8>>, i64)>> {
        let mut c = self.0.clone();
        Box::pin(async move {
            let opts = ahead
                .options()
                .with_max_create_revision(revision - 1)
                .with_keys_only();
            let txn = Txn::new()
                .when([if_created(me, revision)])
                .and_then([TxnOp::get(ahead.prefix(), Some(opts))]);
            let resp = c.txn(txn).await?;
            if !resp.succeeded() {
                return Ok(None);
            }
            let keys = gets(&resp)
                .iter()
                .flat_map(|g| g.kvs().iter().map(|kv| kv.key().to_vec()))
                .collect();
            Ok(Some((keys, revision_of(resp.header()))))
        })
    }

    fn put_if<'a>(
        &'a self,
        me: &'a str,
        revision: i64,
        value: &'a str,
        lease: Option<i64>,
    ) -> Call<'a, bool> {
        let mut c = self.0.clone();
        Box::pin(async move {
            let opts = match lease {
                Some(id) => PutOptions::new().with_lease(id),
                None => PutOptions::new().with_ignore_lease(),
            };
            let txn = Txn::new()
                .when([if_created(me, revision)])
                .and_then([TxnOp::put(me, value, Some(opts))]);
            Ok(c.txn(txn).await?.succeeded())
        })
    }

    fn delete_if<'a>(&'a self, me: &'a str, revision: i64) -> Call<'a, bool> {
        let mut c = self.0.clone();
        Box::pin(async move {
            let txn = Txn::new()
                .when([if_created(me, revision)])
                .and_then([TxnOp::delete(me, None)]);
            Ok(c.txn(txn).await?.succeeded())
        })
    }

    fn delete<'a>(&'a self, key: &'a str) -> Call<'a, ()> {
        let mut c = self.0.clone();
        Box::pin(async move { c.delete(key, None).await.map(drop) })
    }

    fn oldest<'a>(&'a self, prefix: &'a str) -> Call<'a, Option<Entry>> {
        let mut c = self.0.clone();
        Box::pin(async move {
            let first = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1);
            let resp = c.get(prefix, Some(first)).await?;
            Ok(resp.kvs().first().map(|kv| Entry {
                key: String::from_utf8_lossy(kv.key()).into_owned(),
                value: kv.value().to_vec(),
                create_revision: kv.create_revision(),
                lease: kv.lease(),
            }))
        })
    }

    fn count_older<'a>(&'a self, prefix: &'a str, revision: i64) -> Call<'a, usize> {
        let mut c = self.0.clone();
        Box::pin(async move {
            // etcd's `count` ignores the revision filters: count the keys.
            let mut older = GetOptions::new().with_prefix().with_keys_only();
            if revision > 0 {
                older = older.with_max_create_revision(revision - 1);
            }
            Ok(c.get(prefix, Some(older)).await?.kvs().len())
        })
    }

    fn lease_grant(&self, ttl: i64) -> Call<'_, (i64, i64)> {
        let mut c = self.0.clone();
        Box::pin(async move {
            let r = c.lease_grant(ttl, None).await?;
            Ok((r.id(), r.ttl()))
        })
    }

    fn lease_revoke(&self, id: i64) -> Call<'_, ()> {
        let mut c = self.0.clone();
        Box::pin(async move { c.lease_revoke(id).await.map(drop) })
    }

    fn lease_time_to_live(&self, id: i64) -> Call<'_, i64> {
        let mut c = self.0.clone();
        Box::pin(async move { Ok(c.lease_time_to_live(id, None).await?.ttl()) })
    }

    fn lease_keep_alive(&self, id: i64) -> Call<'_, Box<dyn KeepAlive>> {
        let mut c = self.0.clone();
        Box::pin(async move {
            let (keeper, stream) = c.lease_keep_alive(id).await?;
            Ok(Box::new(ClientKeepAlive(keeper, stream)) as Box<dyn KeepAlive>)
        })
    }

    fn watch_deletes<'a>(&'a self, prefix: &'a str) -> Call<'a, Box<dyn DeleteWatch>> {
        let mut c = self.0.clone();
        Box::pin(async move {
            let opts = WatchOptions::new()
                .with_prefix()
                .with_filters([WatchFilterType::NoPut]);
            let stream = c.watch(prefix, Some(opts)).await?;
            Ok(Box::new(ClientWatch(stream)) as Box<dyn DeleteWatch>)
        })
    }
}
