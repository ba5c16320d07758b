//! Test support for the cluster scope: the endpoints of the local etcd
//! cluster that `cluster.sh` started, and its members' pids.
//!
//! The tests run only when `KEYLOCK_ETCD_ENDPOINTS` names a cluster (CI's
//! `etcd` step sets it); otherwise each says so in one loud line and passes
//! without testing. `KEYLOCK_ETCD_DIR` (the directory given to
//! `cluster.sh start`) lets the fault tests kill and restart members;
//! [`Proxy`] lets a test cut one table off the cluster.

#![allow(dead_code, unreachable_pub)]

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

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

/// Runs `cluster.sh CMD DIR` (a command on every member: `restart-all`),
/// answering whether it succeeded (for drop handlers, which must not
/// panic).
pub fn try_cluster(cmd: &str, dir: &std::path::Path) -> bool {
    Command::new("bash")
        .arg(script())
        .arg(cmd)
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success())
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

/// A TCP proxy in front of one member, on a port of its own, that a test
/// can cut: after [`Proxy::cut`] every connection through it is shut down
/// and new ones are refused, so a table connected through it finds the
/// cluster unreachable while the cluster itself (and every other test's
/// table) is untouched. Plain threads, so it runs whatever the runtime.
pub struct Proxy {
    url: String,
    addr: std::net::SocketAddr,
    cut: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    /// Starts a proxy to `target` (`http://host:port`).
    pub fn start(target: &str) -> Proxy {
        let target: std::net::SocketAddr = target
            .trim_start_matches("http://")
            .parse()
            .expect("a member's address");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let (cut2, conns2) = (Arc::clone(&cut), Arc::clone(&conns));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if cut2.load(Ordering::SeqCst) {
                    break; // the listener is dropped: connections refused
                }
                let Ok(client) = client else { continue };
                let Ok(member) = TcpStream::connect(target) else {
                    continue;
                };
                let mut open = conns2.lock().unwrap();
                if cut2.load(Ordering::SeqCst) {
                    // Cut while this one was being connected.
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    let _ = member.shutdown(std::net::Shutdown::Both);
                    break;
                }
                for s in [&client, &member] {
                    open.push(s.try_clone().unwrap());
                }
                drop(open);
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), member.try_clone().unwrap()),
                    (member, client),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Proxy {
            url: format!("http://{addr}"),
            addr,
            cut,
            conns,
        }
    }

    /// The proxy's client URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Shuts every connection through the proxy and refuses new ones.
    pub fn cut(&self) {
        let mut open = self.conns.lock().unwrap();
        self.cut.store(true, Ordering::SeqCst);
        for s in open.drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        drop(open);
        // Wake the accept loop so that it sees the cut and closes.
        let _ = TcpStream::connect(self.addr);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
    }
}
