#!/usr/bin/env python3
"""Writes the hand-written owner seeds of the `ops` target (fuzz/corpus/ops/owner*-*)
into the directory given as the first argument (with a second argument
`known-bugs`, the inputs of bugs found and fixed, now in fuzz/regressions/ops/;
with `open-bugs`, the inputs of open bugs, in fuzz/known-bugs/ops/: none
now).

It encodes inputs as `arbitrary` 1.x decodes `Input`: the config's four fields,
then each op as a continue byte (1), the variant's u32 (index << 28 of 16
variants) and its fields. Owner operations are `StartLock` with `with >= 0xE0`
(see `OwnerOp::of` in fuzz_targets/ops/owners.rs). Check a seed with
`cargo +nightly fuzz fmt ops FILE` or `KEYLOCK_FUZZ_TRACE=1`.
"""
import struct, sys, os
V = ['StartLock','Poll','PollNewWaker','PollWoken','DropFuture','Forget','DropGuard','ReleaseGuard','TryLock','Renew','Revoke','Check','CheckAll','Advance','AdvanceMicros','AdvanceNanos']
def var(n): return b'\x01' + struct.pack('<I', V.index(n) << 28)
def opt(x): return b'\x00' if x is None else bytes([1, x])
def b(x): return bytes([x])
def config(shards=0, collide=0, dl=None, ml=None): return b(shards)+b(collide)+opt(dl)+opt(ml)
LOCK, LOCKALL, POLL, DROPF, UNLOCK, RELEASE, COMMIT, ABORT, DROP, RENEW = 0, 4, 7, 8, 9, 10, 11, 12, 13, 14
DEF, BLOCK, NOWAIT, SKIP = 0, 1, 2, 3
def owner(o, kind, key=0, lease=None, timeout=None, w=0, owned=False):
    return var('StartLock') + b(key) + opt(lease) + opt(timeout) + b(0xE0 | w) + b(int(owned)) + b((o << 4) | kind)
def lock(o, k, shared=False, pol=DEF, now=True, **kw):
    return owner(o, LOCK, key=k | (4 if shared else 0), w=pol, timeout=None if now else 0x80, **kw)
def lock_all(o, reqs, pol=DEF, now=True, **kw):
    key = 0; w = pol
    for i, (k, s) in enumerate(reqs):
        key |= k << (2*i)
        if s: w |= 4 << i
    key |= (len(reqs)-1) << 6
    return owner(o, LOCKALL, key=key, w=w, timeout=None if now else 0x80, **kw)
def try_lock(k, shared=False, lease=None): return var('TryLock') + b(k) + opt(lease) + b(6 if shared else 0) + b(0)
def start_lock(k, shared=False, lease=None, timeout=None, waker=0): return var('StartLock') + b(k) + opt(lease) + opt(timeout) + b(7 if shared else 1) + b(0) + b(waker)
WAKE_BOMB = 128
def poll(f): return var('Poll') + b(f)
def poll_woken(): return var('PollWoken')
def drop_guard(g): return var('DropGuard') + b(g)
def advance(by): return var('Advance') + b(by)
def revoke(k): return var('Revoke') + b(k)
def check_all(): return var('CheckAll')
seeds = {
 'owner-reentry-upgrade': config() + lock(0, 1, True) + lock(0, 1, True) + lock(0, 1) + owner(0, UNLOCK, key=1) + lock(0, 1, True) + owner(0, RELEASE, key=1) + lock(0, 2) + owner(0, COMMIT),
 'owner-lock-all-duplicates': config(1) + try_lock(2, True) + lock_all(0, [(1, False), (1, True), (2, True)]) + lock_all(0, [(2, False)], NOWAIT) + lock_all(0, [(2, False), (3, True)], SKIP) + owner(0, ABORT),
 'owner-lock-all-cancel-undoes-upgrade': config() + try_lock(3) + lock(0, 0, True) + start_lock(0, True) + start_lock(0) + lock_all(0, [(0, False), (3, False)]) + owner(0, POLL) + owner(0, DROPF) + poll(0) + poll(1) + drop_guard(0) + lock_all(0, [(0, False), (3, False)]) + poll_woken() + owner(0, COMMIT) + poll_woken(),
 'owner-skip-locked': config(2) + try_lock(2) + lock_all(1, [(1, False), (2, False), (3, True)], SKIP) + drop_guard(0) + lock_all(1, [(2, False), (1, True)], NOWAIT) + owner(1, DROP),
 'owned-ended-while-pending': config() + try_lock(1) + lock(0, 1, owned=True) + lock(1, 2, owned=True) + lock_all(1, [(2, True), (1, False)]) + owner(0, DROP) + owner(1, COMMIT) + drop_guard(0) + poll_woken() + owner(1, POLL),
 'owned-unlock-in-flight': config() + try_lock(2, True) + lock(0, 2, True, owned=True) + lock(0, 2) + owner(0, UNLOCK, key=2) + owner(0, RELEASE, key=2) + owner(0, LOCK, key=3) + drop_guard(0) + poll_woken() + owner(0, UNLOCK, key=2) + owner(0, COMMIT),
 'owner-lease-lapse-commit': config(0, 0, None, 8) + lock(0, 0, lease=1) + lock(0, 1, True) + start_lock(0) + advance(3) + poll_woken() + owner(0, RENEW, w=4) + owner(0, COMMIT),
 'owned-two-calls-in-flight': config() + try_lock(1) + lock(0, 1, owned=True) + lock(0, 1, True) + lock_all(0, [(2, False), (1, True)]) + lock(0, 3, now=False) + lock(0, 2) + owner(0, POLL, key=1) + drop_guard(0) + poll_woken() + owner(0, UNLOCK, key=1) + lock_all(0, [(1, True), (2, True), (0, True)], now=False) + owner(0, POLL, key=1) + owner(0, COMMIT),
 'owners-upgrade-conflict-skipped': config() + lock(0, 1, True) + lock(1, 1, True) + lock(0, 1) + lock_all(1, [(1, False), (2, False)], SKIP) + lock(1, 1, pol=NOWAIT) + owner(1, COMMIT) + poll_woken() + owner(0, COMMIT),
 # Keys 1 and 2 stored by plain guards with keys whose `Drop` panics: a renew
 # naming a revoked one returns a clone of that key, and a commit clones every
 # key it releases (dropping all but the one its error names), here once with
 # the plain guards still holding, once with them fenced.
 'owner-commit-clones-stored-keys': config() + try_lock(0x71, True) + try_lock(0x72, True) + lock(0, 1, True) + lock(0, 2, True) + owner(0, COMMIT) + lock(1, 1, True) + lock(1, 2, True) + revoke(1) + revoke(2) + owner(1, RENEW, w=4) + owner(1, COMMIT) + lock(2, 2, True, owned=True) + owner(2, COMMIT),
 # Deadlocks (each answered at once, the victim being the transaction
 # whose wait closed the cycle; the victim then aborts and the others go on).
 # Two transactions, exclusive, in opposite orders.
 'owners-deadlock-two': config() + lock(0, 0) + lock(1, 1) + lock(0, 1) + lock(1, 0) + owner(1, ABORT) + poll_woken() + owner(0, COMMIT),
 # Three in a ring, on two shards (the walk crosses shards).
 'owners-deadlock-three-ring': config(1) + lock(0, 0) + lock(1, 1) + lock(2, 2) + lock(0, 1) + lock(1, 2) + lock(2, 0) + owner(2, ABORT) + poll_woken() + owner(1, COMMIT) + poll_woken() + owner(0, COMMIT),
 # Shared and exclusive: 1 waits (exclusive) for 0's shared hold, 0 asks a
 # shared lock of what 1 holds exclusively; a plain reader of key 0 beside
 # 0 is no edge.
 'owners-deadlock-shared': config() + try_lock(0, True) + lock(0, 0, True) + lock(1, 1) + lock(1, 0) + lock(0, 1, True) + owner(0, ABORT) + drop_guard(0) + poll_woken() + owner(1, COMMIT),
 # Upgrades: both hold key 0 shared and 0 holds key 1; 0's upgrade waits
 # for 1's shared hold, 1's wait for key 1 closes the cycle (1 the victim);
 # then the same with the upgrade closing it (0 the victim: its upgrade is
 # undone, the key still held shared).
 'owners-deadlock-upgrade': config() + lock(0, 0, True) + lock(1, 0, True) + lock(0, 1) + lock(0, 0) + lock(1, 1) + owner(1, ABORT) + poll_woken() + owner(0, COMMIT)
   + lock(0, 0, True) + lock(1, 0, True) + lock(0, 1) + lock(1, 1) + lock(0, 0) + owner(0, UNLOCK, key=0) + owner(0, ABORT) + poll_woken() + owner(1, COMMIT),
 # Behind a queued waiter: 2 holds key 0, 1 queues for it, 0 queues behind 1
 # (a shared ask behind a queued writer), 2 asks key 1 which 0 holds: the
 # cycle 2 -> 0 -> 1 -> 2 goes through the queue.
 'owners-deadlock-queued-waiter': config() + lock(0, 1) + lock(2, 0) + lock(1, 0) + lock(0, 0, True) + lock(2, 1) + owner(2, ABORT) + poll_woken() + owner(1, COMMIT) + poll_woken() + owner(0, COMMIT),
 # lock_all: 0's lock_all waits for key 1 (held by 1) holding what it took;
 # 1's wait for key 0 closes the cycle; then 1's lock_all is the victim and
 # releases the keys it took in that call (2, 3).
 'owners-deadlock-lock-all': config(2) + lock(1, 1) + lock_all(0, [(0, False), (1, False)]) + lock(1, 0) + owner(1, ABORT) + poll_woken() + owner(0, COMMIT)
   + lock(0, 0) + lock(1, 1) + lock(0, 1) + lock_all(1, [(2, False), (0, False), (3, True)]) + owner(1, COMMIT) + poll_woken() + owner(0, COMMIT),
 # An owned transaction with two waits: only its first is registered; a
 # cycle through the second is not found (it keeps its deadline), one
 # through the first is.
 'owners-deadlock-owned-second-wait': config() + lock(0, 0, owned=True) + lock(1, 1) + lock(2, 2) + lock(0, 1) + lock(0, 2) + lock(2, 0) + lock(1, 0) + owner(1, ABORT) + owner(2, ABORT) + poll_woken() + owner(0, POLL) + owner(0, COMMIT),
 # A holder whose lease lapsed blocks nobody: 0 waits for key 1, whose
 # holder 1 (1 ms leases) lapses unsettled; 1's wait for key 0 closes no
 # cycle. Then the same with 1's lease renewed in time: a deadlock.
 'owners-deadlock-lapsed-holder': config() + lock(0, 0) + lock(1, 1, lease=1) + lock(0, 1) + advance(2) + lock(1, 0) + poll_woken() + owner(0, COMMIT) + poll_woken() + owner(1, COMMIT)
   + lock(0, 0) + lock(1, 1, lease=2) + lock(0, 1) + advance(1) + lock(1, 0) + owner(1, ABORT) + poll_woken() + owner(0, COMMIT),
 # Ten deadlocks in a row: recent_deadlocks keeps the last eight.
 'owners-deadlock-history': config() + (lock(0, 0) + lock(1, 1) + lock(0, 1) + lock(1, 0) + owner(1, ABORT) + poll_woken() + owner(0, COMMIT)) * 5
   + (lock(1, 2) + lock(0, 3, True) + lock(1, 3) + lock(0, 2) + owner(0, ABORT) + poll_woken() + owner(1, COMMIT)) * 5,
 # Edges a search keeps (deadlock.rs, "Cached edges"), gone stale without a
 # queue jump. 3 waits for 2's key 3, so every later wait searches. 1 keeps
 # an edge to 5 queued exclusive ahead of it; 5 (holding nothing, not
 # registered) leaves and queues again shared; 0's wait closes 0 -> 2 -> 0,
 # which the stale mode must not hide.
 'owners-deadlock-stale-cached-mode': config() + lock(4, 3) + lock(3, 2) + lock(3, 3) + lock(0, 0, True) + lock(1, 1, True) + lock(2, 1, True)
   + start_lock(0) + poll(0) + lock(5, 0) + lock(1, 0, True) + owner(5, DROPF) + lock(2, 0) + lock(5, 0, True) + lock(0, 1)
   + owner(0, ABORT) + poll_woken() + drop_guard(0) + poll_woken() + owner(2, ABORT) + poll_woken() + owner(1, COMMIT) + owner(5, COMMIT) + owner(3, ABORT) + owner(4, COMMIT),
 # 3 keeps an edge to 2 holding key 1; 2 lets it go and, holding nothing,
 # queues for key 2 behind 1's grant; 4 queues behind 2; 0's wait closes
 # 0 -> 4 -> 2 -> 1 -> 0, which the stale holder edge must not hide (a soft
 # cycle: found, 4 is granted key 2 ahead of 2).
 'owners-deadlock-stale-holder-edge': config() + lock(0, 3) + lock(1, 2, True) + lock(1, 3) + lock(2, 1, True) + try_lock(1, True) + lock(3, 0, True) + lock(3, 1)
   + owner(2, RELEASE, key=1) + lock(4, 0, True) + lock(2, 2) + lock(4, 2, True) + lock(0, 0)
   + owner(0, ABORT) + poll_woken() + owner(1, COMMIT) + poll_woken() + owner(2, COMMIT) + poll_woken() + owner(4, COMMIT) + drop_guard(0) + poll_woken() + owner(3, COMMIT),
 # Soft deadlocks (deadlock.rs, "Soft deadlocks"): broken by granting a
 # shared waiter of the cycle ahead of the queue, on a key its holders
 # admit, instead of answering anyone. PostgreSQL's deadlock-soft: 0 and 1
 # hold keys 1 and 2 shared, 2 and 3 (holding nothing: not registered) wait
 # for them exclusive, 0 asks key 2 shared (behind 3), 1 asks key 1 shared
 # (behind 2): 0 is granted key 2 ahead of 3; everyone completes.
 'owners-deadlock-soft': config() + lock(0, 1, True) + lock(1, 2, True) + lock(2, 1) + lock(3, 2) + lock(0, 2, True) + lock(1, 1, True)
   + poll_woken() + owner(0, COMMIT) + poll_woken() + owner(2, COMMIT) + poll_woken() + owner(1, COMMIT) + poll_woken() + owner(3, COMMIT),
 # deadlock-soft-2: 0 (owned, 2 ms leases) holds key 1, 1 holds key 2
 # shared and waits for key 1; 2 and 3 wait for key 2 exclusive; 0's ask
 # of key 2 shared closes two cycles, and 0's own waiter goes ahead of
 # both writers (its lease, the earliest, nudges the head to re-arm).
 'owners-deadlock-soft-2': config() + lock(0, 1, lease=2, owned=True) + lock(1, 2, True) + lock(1, 1) + lock(2, 2) + lock(3, 2) + lock(0, 2, True)
   + poll_woken() + owner(0, POLL) + owner(0, COMMIT) + poll_woken() + owner(1, COMMIT) + poll_woken() + owner(2, COMMIT) + poll_woken() + owner(3, COMMIT),
 # A soft edge no grant breaks: 0 holds key 1, 1 (made first) waits for it,
 # 2 holds key 2; 0 asks key 2 shared; 2's ask of key 1 shared, behind 1
 # and blocked by 0's exclusive grant, closes 2 -> 1 -> 0 -> 2: answered.
 'owners-deadlock-soft-hard': config() + lock(1, 3) + lock(0, 1) + lock(2, 2) + lock(1, 1) + lock(0, 2, True) + lock(2, 1, True)
   + owner(2, ABORT) + poll_woken() + owner(0, COMMIT) + poll_woken() + owner(1, COMMIT),
 'owners-opposite-lock-all': config(0, 1) + lock_all(0, [(0, False), (1, False)], now=False) + lock_all(1, [(1, False), (0, False)], now=False) + owner(0, POLL) + owner(1, POLL) + try_lock(0, True) + owner(0, COMMIT) + poll_woken() + owner(1, POLL) + owner(1, DROP) + lock_all(2, [(0, True), (1, True), (2, True)], owned=True) + revoke(1) + owner(2, RENEW, w=4) + owner(2, COMMIT),
}
# Inputs of bugs found (now fuzz/regressions/ops/), failing on the code that had them.
known_bugs = {
 # A dropped lock_all undoes its upgrade of key 1; the downgrade admits a
 # reader whose waker panics: the owner loses key 1 (owner_undo_wake_panic).
 'owner-undo-wake-panic': config() + lock(0, 1, True) + try_lock(2) + lock_all(0, [(1, False), (2, False)]) + start_lock(1, True, waker=WAKE_BOMB) + poll(0) + owner(0, DROPF) + owner(0, LOCK, key=1 | 4),
 # Key 1 stored by a plain reader whose key panics when dropped; transaction
 # 0 holds it shared too and upgrades (waits for the reader): the upgrade
 # names the key by a clone of the stored instance, and its registration
 # with the deadlock detector by another; once the reader goes, the poll
 # that sees the upgrade granted drops them and panics
 # (owner_upgrade_key_clone). The same through a lock_all, whose stage
 # then does not undo the upgrade.
 'owner-upgrade-key-clone': config() + try_lock(0x71, True) + lock(0, 1, True) + lock(0, 1) + drop_guard(0) + poll_woken() + owner(0, COMMIT),
 'owner-upgrade-key-clone-lock-all': config() + try_lock(0x71, True) + lock(0, 1, True) + lock_all(0, [(1, False), (2, False)]) + drop_guard(0) + poll_woken() + owner(0, COMMIT),
}
out = sys.argv[1]
open_bugs = {}
which = {'known-bugs': known_bugs, 'open-bugs': open_bugs}.get(sys.argv[2] if len(sys.argv) > 2 else '', seeds)
for name, data in which.items():
    open(os.path.join(out, name), 'wb').write(data)
