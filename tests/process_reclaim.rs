//! The process scope's reclaim of idle keys' files (issue 27, item 5): a
//! table reclaims the files of keys it stops caching, `prune` reclaims
//! every idle key's, and no reclaim ever makes two holders of a key or
//! lets its fencing tokens go back, across tables, processes and table
//! reopenings. Children are this test binary re-invoked with
//! `KEYLOCK_RECLAIM_CHILD` naming their role. No assertion depends on
//! timing: the timeouts here only keep a broken build from hanging.
#![cfg(target_os = "linux")]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::task::Poll;
use std::time::Duration;

use futures::executor::block_on;
use keylock::process::ProcessStats;
use keylock::{LockOptions, ProcessLockError, ProcessLockTable};

mod common;
use common::poll_noop as poll;

const ROLE: &str = "KEYLOCK_RECLAIM_CHILD";
const PATIENCE: Duration = Duration::from_secs(30);

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("keylock-reclaim-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The key files in `dir` (`key-*.state`).
fn key_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("key-") && n.ends_with(".state"))
        .collect();
    names.sort();
    names
}

/// Bytes the directory's files take on the disk.
fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().blocks() * 512)
        .sum()
}

/// Prunes `dir` through `table` until no key file is left, every other
/// table of the directory gone. A helper thread of a waiter dropped while
/// it waited may still hold a key file's slot for an instant (the kernel
/// handed it the slot just before it saw itself abandoned), which makes a
/// reclaim refuse the file. So between attempts this waits, in the kernel,
/// for every lock of every key file left to be let go (a blocking `flock`
/// of the file, slot 0's lock, and a blocking exclusive open file
/// description lock of the whole file, the other slots' and the claim's):
/// each round ends on the locks' state, never on elapsed time. An abandoned
/// helper still blocked in the kernel may win the lock after us, once;
/// hence a few rounds.
fn prune_until_no_key_file(dir: &Path, table: &ProcessLockTable<&str>) {
    use std::os::fd::AsRawFd;
    const ROUNDS: usize = 100;
    for _ in 0..ROUNDS {
        table.prune().unwrap();
        let left = key_files(dir);
        if left.is_empty() {
            return;
        }
        for name in left {
            let Ok(file) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(dir.join(&name))
            else {
                continue; // reclaimed meanwhile
            };
            let fd = file.as_raw_fd();
            // SAFETY: `fd` is an open descriptor for the whole call.
            assert_eq!(unsafe { libc::flock(fd, libc::LOCK_EX) }, 0);
            // SAFETY: a zeroed `flock` is a valid value of the plain C struct.
            let mut range: libc::flock = unsafe { std::mem::zeroed() };
            range.l_type = libc::F_WRLCK as libc::c_short;
            range.l_whence = libc::SEEK_SET as libc::c_short;
            // SAFETY: `fd` is open and `range` a valid `flock` (start 0,
            // length 0: the whole file).
            assert_eq!(unsafe { libc::fcntl(fd, libc::F_OFD_SETLKW, &range) }, 0);
            drop(file); // closing it lets go of both
        }
    }
    panic!(
        "key files left after {ROUNDS} prunes, each after every lock of them was let go: {:?}",
        key_files(dir)
    );
}

// ---------------------------------------------------------------- children

/// The child side. Does nothing in a normal test run.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let dir = PathBuf::from(std::env::var("KL_DIR").unwrap());
    match role.as_str() {
        "lock-once" => {
            // Take the key once, say its token, and exit (dropping the
            // table reclaims the key's file).
            let table = ProcessLockTable::open(&dir).unwrap();
            let guard =
                block_on(table.lock_with("k", LockOptions::new().timeout(PATIENCE))).unwrap();
            say(&format!("token {}", guard.token().get()));
        }
        "stress" => {
            let seed: u64 = std::env::var("KL_SEED").unwrap().parse().unwrap();
            let n: usize = std::env::var("KL_N").unwrap().parse().unwrap();
            stress(&dir, seed, n);
            say("done");
        }
        other => panic!("unknown role {other}"),
    }
}

fn say(line: &str) {
    println!("@@ {line}");
    std::io::stdout().flush().unwrap();
}

/// Runs this binary as a child in role `role` and returns its `@@` lines.
fn run_child(role: &str, dir: &Path, env: &[(&str, String)]) -> Vec<String> {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env("KL_DIR", dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let lines = out
        .lines()
        .map(Result::unwrap)
        .filter_map(|l| l.find("@@ ").map(|at| l[at + 3..].trim_end().to_owned()))
        .collect();
    let status = child.wait().unwrap();
    assert!(status.success(), "child {role} failed: {status}");
    lines
}

// ---------------------------------------------------------------- bounded files

#[test]
fn many_distinct_keys_leave_a_bounded_number_of_files() {
    let dir = temp_dir("bounded");
    let table = ProcessLockTable::<String>::open(&dir).unwrap();
    for i in 0..400 {
        drop(table.try_lock(format!("job-{i}")).unwrap());
    }
    // The files of keys the table stopped caching were reclaimed.
    let left = key_files(&dir).len();
    assert!(
        left <= ProcessStats::MAX_CACHED_KEYS,
        "{left} key files after 400 distinct keys"
    );
    assert_eq!(left, table.stats().cached_keys, "exactly the cached keys");
    // `prune` reclaims the rest: no key file, one directory file.
    assert_eq!(table.prune().unwrap(), left);
    assert_eq!(key_files(&dir), Vec::<String>::new());
    assert_eq!(table.stats().cached_keys, 0);
    assert!(disk_bytes(&dir) <= 8192, "{} bytes", disk_bytes(&dir));
    // A table that goes away reclaims the files it cached.
    let other = ProcessLockTable::<String>::open(&dir).unwrap();
    for i in 0..10 {
        drop(other.try_lock(format!("other-{i}")).unwrap());
    }
    assert_eq!(key_files(&dir).len(), 10);
    drop(other);
    assert_eq!(key_files(&dir), Vec::<String>::new());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn prune_leaves_held_cached_and_waited_for_keys_alone() {
    let dir = temp_dir("busy");
    let a = ProcessLockTable::<&str>::open(&dir).unwrap();
    let b = ProcessLockTable::<&str>::open(&dir).unwrap();
    let held = a.try_lock("held").unwrap();
    drop(a.try_lock("cached").unwrap()); // open in a's cache
    let waited = b.try_lock("waited").unwrap();
    let mut waiter = Box::pin(a.lock_with("waited", LockOptions::new().timeout(PATIENCE)));
    assert!(poll(waiter.as_mut()).is_pending());
    drop(b.try_lock("idle").unwrap());
    // b reclaims its own cache ("idle"); every other file is in use.
    assert_eq!(b.prune().unwrap(), 1);
    assert_eq!(
        key_files(&dir),
        ["key-cached.state", "key-held.state", "key-waited.state"]
    );
    // The keys still exclude each other through those files.
    assert!(matches!(
        b.try_lock("held"),
        Err(ProcessLockError::WouldBlock { .. })
    ));
    let t = waited.token();
    drop(waited);
    let got = block_on(waiter).unwrap();
    assert!(got.token() > t);
    let c = a.try_lock("cached").unwrap();
    assert!(c.check().is_ok());
    drop((held, got, c));
    // b caches "waited" (it held it last) and "held" (its try_lock opened
    // it): a reclaims "cached" only, b the other two.
    assert_eq!(a.prune().unwrap(), 1, "{:?}", key_files(&dir));
    assert_eq!(key_files(&dir), ["key-held.state", "key-waited.state"]);
    assert_eq!(b.prune().unwrap(), 2);
    assert_eq!(key_files(&dir), Vec::<String>::new());
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- tokens

#[test]
fn tokens_of_a_key_increase_across_reclaim_and_reopening() {
    let dir = temp_dir("tokens");
    let mut last = 0;
    for round in 0..5 {
        let table = ProcessLockTable::<&str>::open(&dir).unwrap();
        for _ in 0..3 {
            let token = table.try_lock("k").unwrap().token().get();
            assert!(token > last, "round {round}: {token} after {last}");
            last = token;
            // Reclaimed between grants: the file is gone.
            assert!(table.prune().unwrap() >= 1);
            assert_eq!(key_files(&dir), Vec::<String>::new());
        }
        // A key that never was reclaimed, then the table goes away (its
        // cache is reclaimed): the next table starts above.
        let token = table.try_lock("k").unwrap().token().get();
        assert!(token > last);
        last = token;
        drop(table);
        assert_eq!(key_files(&dir), Vec::<String>::new());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tokens_of_a_key_increase_across_processes_that_reclaim_it() {
    let dir = temp_dir("tokens-proc");
    let mut last = 0;
    for _ in 0..4 {
        let lines = run_child("lock-once", &dir, &[]);
        let token: u64 = lines[0].strip_prefix("token ").unwrap().parse().unwrap();
        assert!(token > last, "{token} after {last}");
        last = token;
        // The child's table reclaimed the file as it went.
        assert_eq!(key_files(&dir), Vec::<String>::new());
        let table = ProcessLockTable::<&str>::open(&dir).unwrap();
        let token = table.try_lock("k").unwrap().token().get();
        assert!(token > last, "{token} after {last}");
        last = token;
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- exclusion

const STRESS_KEYS: [&str; 4] = ["a", "b", "c", "d"];

/// One participant of the stress: random keys, random ways of locking
/// (try, wait, wait and be cancelled), random prunes, and its table
/// dropped (reclaiming what it cached) and opened again now and then. A
/// grant proves it is alone by creating its key's marker file exclusively,
/// and logs its token.
fn stress(dir: &Path, seed: u64, n: usize) {
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut table = ProcessLockTable::<&str>::open(dir).unwrap();
    let log_path = dir.join(format!("log-{seed}"));
    let mut log = std::fs::File::create(&log_path).unwrap();
    let critical = |key: &str, token: u64, log: &mut std::fs::File| {
        let marker = dir.join(format!("in-{key}"));
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&marker)
            .unwrap_or_else(|e| panic!("two holders of {key} (token {token}): {e}"));
        writeln!(log, "{key} {token}").unwrap();
        std::thread::yield_now();
        std::fs::remove_file(&marker).unwrap();
    };
    for _ in 0..n {
        let key = STRESS_KEYS[(next() % 4) as usize];
        if next() % 40 == 0 {
            table = ProcessLockTable::<&str>::open(dir).unwrap();
        }
        match next() % 5 {
            0 => {
                if let Ok(g) = table.try_lock(key) {
                    let token = g.check().unwrap().get();
                    critical(key, token, &mut log);
                }
            }
            1 | 2 => {
                let g =
                    block_on(table.lock_with(key, LockOptions::new().timeout(PATIENCE))).unwrap();
                let token = g.check().unwrap().get();
                critical(key, token, &mut log);
            }
            3 => {
                // Cancelled: polled once, then dropped (or granted at once,
                // then released).
                let mut f = Box::pin(table.lock(key));
                if let Poll::Ready(g) = poll(f.as_mut()) {
                    let g = g.unwrap();
                    let token = g.check().unwrap().get();
                    critical(key, token, &mut log);
                }
            }
            _ => {
                table.prune().unwrap();
            }
        }
    }
}

/// Per key, the tokens logged by every participant (each log in its own
/// order), checked to be distinct; and each participant's own tokens of a
/// key strictly increase.
fn check_logs(dir: &Path) -> usize {
    let mut seen: HashMap<String, Vec<u64>> = HashMap::new();
    let mut grants = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if !name.starts_with("log-") {
            continue;
        }
        let text = std::fs::read_to_string(dir.join(&name)).unwrap();
        let mut mine: HashMap<&str, u64> = HashMap::new();
        for line in text.lines() {
            let (key, token) = line.split_once(' ').unwrap();
            let token: u64 = token.parse().unwrap();
            let before = mine.insert(key, token).unwrap_or(0);
            assert!(token > before, "{name}: {key} {token} after {before}");
            seen.entry(key.to_owned()).or_default().push(token);
            grants += 1;
        }
    }
    for (key, mut tokens) in seen {
        let n = tokens.len();
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), n, "a token of {key} granted twice");
    }
    grants
}

#[test]
fn reclaim_racing_locks_never_makes_two_holders_across_tables_and_processes() {
    let dir = temp_dir("stress");
    const N: usize = 1500;
    let kids: Vec<_> = (0..2u64)
        .map(|i| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                run_child(
                    "stress",
                    &dir,
                    &[("KL_SEED", (1000 + i).to_string()), ("KL_N", N.to_string())],
                )
            })
        })
        .collect();
    std::thread::scope(|s| {
        for seed in [7u64, 11] {
            let dir = &dir;
            s.spawn(move || stress(dir, seed, N));
        }
    });
    for kid in kids {
        assert_eq!(kid.join().unwrap(), ["done"]);
    }
    let grants = check_logs(&dir);
    assert!(grants > 0);
    // Everything idle now: one prune leaves no key file.
    let table = ProcessLockTable::<&str>::open(&dir).unwrap();
    prune_until_no_key_file(&dir, &table);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- waiters

#[test]
fn a_dropped_waiter_never_strands_a_key_through_reclaim() {
    let dir = temp_dir("dropped");
    let holder = ProcessLockTable::<&str>::open(&dir).unwrap();
    let waiting = ProcessLockTable::<&str>::open(&dir).unwrap();
    let g = holder.try_lock("k").unwrap();
    // A waiter at the file level, dropped while it waits.
    let mut first = Box::pin(waiting.lock("k"));
    assert!(poll(first.as_mut()).is_pending());
    assert_eq!(waiting.stats().file_waiters, 1);
    drop(first);
    assert_eq!(waiting.stats().file_waiters, 0);
    // (A waiter forgotten while it waits at the file level, polled first so
    // that its helper really waits in the kernel: see
    // `a_forgotten_file_level_waiter_does_not_strand_the_key`.)
    let t = g.token();
    drop(g);
    // Everything reclaimable: the key's files are not kept by the dropped
    // waiter (its files went back to its table's cache, or were closed;
    // its helper lets go of the slot the kernel hands it at once).
    waiting.prune().unwrap();
    prune_until_no_key_file(&dir, &holder);
    let again = waiting.try_lock("k").unwrap();
    assert!(again.token() > t);
    drop(again);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_file_removed_from_outside_while_cached_is_still_never_locked_twice() {
    // Reclaim reuses the look of "the path names the open file": a file
    // removed by someone else (not reclaimed) is noticed as before.
    let dir = temp_dir("outside");
    let a = ProcessLockTable::<&str>::open(&dir).unwrap();
    let b = ProcessLockTable::<&str>::open(&dir).unwrap();
    drop(a.try_lock("k").unwrap());
    std::fs::remove_file(dir.join("key-k.state")).unwrap();
    let gb = b.try_lock("k").unwrap();
    assert!(matches!(
        a.try_lock("k"),
        Err(ProcessLockError::WouldBlock { .. })
    ));
    drop(gb);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- power loss

/// A key file whose name reached the disk but whose contents did not (its
/// creation is not synced any more): empty, or a zero header, and last
/// changed before this boot. It is made afresh on use, and pruned; a file
/// blanked during this boot is damage from outside and still refused.
#[test]
fn a_key_file_left_blank_by_a_power_loss_is_made_afresh() {
    let dir = temp_dir("blank");
    let before_boot = std::time::UNIX_EPOCH + Duration::from_secs(1_000_000);
    let blank = |name: &str, len: u64, changed: Option<std::time::SystemTime>| {
        let file = std::fs::File::create(dir.join(name)).unwrap();
        file.set_len(len).unwrap();
        if let Some(at) = changed {
            file.set_modified(at).unwrap();
        }
    };
    blank("key-empty.state", 0, Some(before_boot));
    blank("key-zeros.state", 28_672, Some(before_boot));
    blank("key-pruned.state", 0, Some(before_boot));
    blank("key-today.state", 0, None);
    let table = ProcessLockTable::<&str>::open(&dir).unwrap();
    for key in ["empty", "zeros"] {
        let guard = table.try_lock(key).unwrap();
        assert!(guard.check().is_ok());
    }
    let err = table.try_lock("today").unwrap_err();
    assert!(err.to_string().contains("key-today.state"), "{err}");
    // prune: the two cached keys, and the blank file from before the boot;
    // not the one blanked today.
    assert_eq!(table.prune().unwrap(), 3);
    assert_eq!(key_files(&dir), ["key-today.state"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// After a reboot the directory's floor restarts at its durable ceiling:
/// a key whose file was reclaimed (or lost) before the reboot, and whose
/// floor in the page cache was lost with it, starts above every token
/// handed out before. The reboot is forged: `keylock.dir`'s boot id (bytes
/// 8 to 24) zeroed, and its floor (24) and published ceiling (32) lost.
#[test]
fn after_a_forged_reboot_a_reclaimed_key_starts_above_the_durable_ceiling() {
    use std::os::unix::fs::FileExt;
    let dir = temp_dir("reboot");
    let table = ProcessLockTable::<&str>::open(&dir).unwrap();
    let mut last = 0;
    for _ in 0..5 {
        last = table.try_lock("k").unwrap().token().get();
    }
    drop(table); // reclaims "k"
    assert_eq!(key_files(&dir), Vec::<String>::new());
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("keylock.dir"))
        .unwrap();
    file.write_all_at(&[0u8; 32], 8).unwrap();
    drop(file);
    let table = ProcessLockTable::<&str>::open(&dir).unwrap();
    let token = table.try_lock("k").unwrap().token().get();
    assert!(token > last, "{token} after {last}");
    drop(table);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A lock future forgotten (`mem::forget`) while it waits at the file
/// level: its helper thread gets the slot's kernel lock when the holder
/// lets it go, and nobody ever takes the key with it. Judgements respect
/// a slot locked with no grant only for a short patience, then take the
/// key on another slot: the key is not stranded. (Without the patience the
/// locks below wait for ever: the test fails by their timeouts.)
#[test]
fn a_forgotten_file_level_waiter_does_not_strand_the_key() {
    let dir = temp_dir("forgotten");
    let holder = ProcessLockTable::<&str>::open(&dir).unwrap();
    let forgetful = ProcessLockTable::<&str>::open(&dir).unwrap();
    let other = ProcessLockTable::<&str>::open(&dir).unwrap();
    let g = holder.try_lock("k").unwrap();
    let mut f = Box::pin(forgetful.lock("k"));
    assert!(poll(f.as_mut()).is_pending());
    assert_eq!(forgetful.stats().file_waiters, 1);
    std::mem::forget(f);
    let mut last = g.token();
    drop(g);
    let patient = || LockOptions::new().timeout(PATIENCE);
    for table in [&other, &holder, &other] {
        let g = block_on(table.lock_with("k", patient())).unwrap();
        assert!(g.token() > last);
        assert!(g.check().is_ok());
        last = g.token();
        drop(g);
        let g = table.blocking_lock_with("k", patient()).unwrap();
        assert!(g.token() > last);
        last = g.token();
    }
    // The forgotten future keeps its files open (leaked with it): the key's
    // file is in use, so it is not reclaimed.
    assert_eq!(other.prune().unwrap(), 0);
    assert_eq!(key_files(&dir), ["key-k.state"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A shared open file description lock of every byte of `file` (the user
/// byte included), as a creator holds on its temporary file.
fn hold_shared(file: &std::fs::File) {
    use std::os::fd::AsRawFd;
    // SAFETY: all zeros is a valid `flock` struct (l_pid must be 0).
    let mut req: libc::flock = unsafe { std::mem::zeroed() };
    req.l_type = libc::F_RDLCK as libc::c_short;
    req.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: `req` is borrowed for the call; `file` keeps its descriptor.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut req) };
    assert_eq!(rc, 0, "fcntl: {}", std::io::Error::last_os_error());
}

/// A creator's temporary file is pruned only once no creator holds it. Its
/// pid here is one no process of this namespace has (as for a creator in
/// another PID namespace sharing the directory): while it holds its user
/// byte the file stays; once it lets go (as the kernel does for a creator
/// that died) `prune` removes it. Keys are made as usual meanwhile.
#[test]
fn prune_removes_a_temporary_file_only_once_no_creator_holds_it() {
    let dir = temp_dir("tmpfile");
    let table = ProcessLockTable::<&str>::open(&dir).unwrap();
    // Above any pid Linux hands out (`pid_max` is at most 2^22).
    let tmp = dir.join(".keylock-new-4194305-0");
    let creator = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&tmp)
        .unwrap();
    hold_shared(&creator);
    table.prune().unwrap();
    assert!(tmp.exists(), "a live creator's temporary file was removed");
    drop(table.try_lock("made-meanwhile").unwrap());
    drop(creator);
    table.prune().unwrap();
    assert!(
        !tmp.exists(),
        "a temporary file nobody holds was left behind"
    );
    drop(table.try_lock("made-after").unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}
