//! Test support for the cluster scope: the endpoints of the local etcd
//! cluster that `cluster.sh` started, and its members' pids.
//!
//! The tests run only when `KEYLOCK_ETCD_ENDPOINTS` names a cluster (CI's
//! `etcd` step sets it); otherwise each says so in one loud line and passes
//! without testing. `KEYLOCK_ETCD_DIR` (the directory given to
//! `cluster.sh start`) lets the fault tests kill and restart members.

#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::process::Command;

/// The cluster's client URLs, or `None` (after one loud line) if no
/// cluster was given.
pub fn endpoints(test: &str) -> Option<Vec<String>> {
    match std::env::var("KEYLOCK_ETCD_ENDPOINTS") {
        Ok(e) if !e.trim().is_empty() => Some(e.split(',').map(|s| s.trim().to_owned()).collect()),
        _ => {
            eprintln!(
                "!!! SKIPPED {test}: no etcd cluster (set KEYLOCK_ETCD_ENDPOINTS, e.g. with \
                 tests/etcd_cluster/cluster.sh start DIR)"
            );
            None
        }
    }
}

/// The cluster's state directory, for killing and restarting members.
pub fn cluster_dir(test: &str) -> Option<PathBuf> {
    match std::env::var("KEYLOCK_ETCD_DIR") {
        Ok(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => {
            eprintln!("!!! SKIPPED {test}: KEYLOCK_ETCD_DIR not set (the cluster's directory)");
            None
        }
    }
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/etcd_cluster/cluster.sh")
}

/// Runs `cluster.sh CMD DIR N`.
pub fn member(cmd: &str, dir: &std::path::Path, n: u32) {
    let status = Command::new("bash")
        .arg(script())
        .arg(cmd)
        .arg(dir)
        .arg(n.to_string())
        .status()
        .expect("run cluster.sh");
    assert!(status.success(), "cluster.sh {cmd} {n} failed");
}

/// Runs `cluster.sh CMD DIR N`, answering whether it succeeded (for drop
/// handlers, which must not panic).
pub fn try_member(cmd: &str, dir: &std::path::Path, n: u32) -> bool {
    Command::new("bash")
        .arg(script())
        .arg(cmd)
        .arg(dir)
        .arg(n.to_string())
        .status()
        .is_ok_and(|s| s.success())
}

/// A prefix of etcd keys of its own for one test run.
pub fn prefix(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("keylock-test/{test}/{}-{nanos}", std::process::id())
}
