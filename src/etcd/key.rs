//! Key encoding and waiter keys: how a key's bytes become an etcd key
//! prefix, and what a waiter key's value says of its owner.
//!
//! A key's bytes map to a path segment by a reversible rule (so distinct
//! keys never share a prefix): `a`-`z`, `A`-`Z`, `0`-`9`, `-`, `_` and `.`
//! stand for themselves, every other byte (`/` included) becomes `%` and two
//! upper case hex digits. The waiter key of a lease (an exclusive grant's)
//! is `<table prefix>/<encoded key>/<lease id, 16 hex digits>`; a shared
//! grant's is `<table prefix>/<encoded key>/r-<lease id>-<n>`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::error::ClusterHolder;
use crate::FencingToken;

/// The path segment of a key.
pub(crate) fn encode(key: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(key.len());
    for &b in key {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.' {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 15)] as char);
        }
    }
    out
}

/// The key of `stem` (made by [`encode`]) as an error names it: its bytes
/// as a quoted string when they are UTF-8 (`"k"`), else escaped
/// (`b"\xff"`).
pub(crate) fn name(stem: &str) -> Box<str> {
    let raw = stem.as_bytes();
    let mut bytes = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let hex = (raw[i] == b'%')
            .then(|| std::str::from_utf8(raw.get(i + 1..i + 3)?).ok())
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(b) => {
                bytes.push(b);
                i += 3;
            }
            None => {
                bytes.push(raw[i]);
                i += 1;
            }
        }
    }
    match std::str::from_utf8(&bytes) {
        Ok(text) => format!("{text:?}").into_boxed_str(),
        Err(_) => format!("b\"{}\"", bytes.escape_ascii()).into_boxed_str(),
    }
}

/// The prefix under which a key's waiter keys live (with its trailing `/`).
pub(crate) fn key_prefix(table_prefix: &str, stem: &str) -> String {
    format!("{table_prefix}/{stem}/")
}

/// The waiter key of a lease under a key's prefix: an exclusive grant's
/// (a writer's), one per lease and key (the in-process tier lets one
/// writer of a table at a time into etcd).
pub(crate) fn waiter_key(prefix: &str, lease_id: i64) -> String {
    format!("{prefix}{lease_id:016x}")
}

/// The waiter key of a shared grant (a reader's): `r-<lease id>-<n>`, one
/// per grant, since a table may have several readers of a key in etcd at
/// once. Writers' names are 16 lower-case hex digits and readers' start
/// with `r`, after every hex digit, so a key's writers are the range
/// `[prefix, writers_end(prefix))`.
pub(crate) fn reader_key(prefix: &str, lease_id: i64, n: u64) -> String {
    format!("{prefix}r-{lease_id:016x}-{n:x}")
}

/// The end (excluded) of the range of a key's writers' waiter keys.
pub(crate) fn writers_end(prefix: &str) -> String {
    format!("{prefix}g")
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The host name, read once.
fn host() -> Option<&'static str> {
    static HOST: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
    })
    .as_deref()
}

/// The value of a waiter key: one `name=value` line per field; `since` (the
/// holder's wall clock, in ms since the epoch, when it took the key) is
/// added once it holds the key.
pub(crate) fn stamp(label: Option<&str>, held: bool) -> String {
    let mut out = format!("keylock=1\npid={}\n", std::process::id());
    if let Some(h) = host() {
        out.push_str(&format!("host={}\n", h.replace('\n', " ")));
    }
    if let Some(l) = label {
        out.push_str(&format!("label={}\n", l.replace('\n', " ")));
    }
    if held {
        out.push_str(&format!("since={}\n", unix_ms()));
    }
    out
}

/// Reads a waiter key's entry as the holder it names.
pub(crate) fn holder_of(create_revision: i64, lease: i64, value: &[u8]) -> Option<ClusterHolder> {
    let token = FencingToken::new(u64::try_from(create_revision).ok()?)?;
    let mut holder = ClusterHolder {
        lease_id: lease,
        token,
        held_for: None,
        pid: None,
        host: None,
        label: None,
    };
    let value = String::from_utf8_lossy(value);
    for line in value.lines() {
        let Some((name, v)) = line.split_once('=') else {
            continue;
        };
        match name {
            "pid" => holder.pid = v.parse().ok(),
            "host" => holder.host = Some(v.to_owned()),
            "label" => holder.label = Some(v.to_owned()),
            "since" => {
                holder.held_for = v
                    .parse::<u64>()
                    .ok()
                    .map(|since| Duration::from_millis(unix_ms().saturating_sub(since)));
            }
            _ => {}
        }
    }
    Some(holder)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_escapes_the_separator() {
        assert_eq!(encode(b"invoice-17"), "invoice-17");
        assert_eq!(encode(b"a/b"), "a%2Fb");
        assert_eq!(encode(b"%"), "%25");
        assert_ne!(encode(b"a/b"), encode(b"a%2Fb"));
        assert_eq!(
            waiter_key(&key_prefix("t", "k"), 255),
            "t/k/00000000000000ff"
        );
    }

    #[test]
    fn keys_are_named_as_given() {
        assert_eq!(&*name(&encode(b"k")), r#""k""#);
        assert_eq!(&*name(&encode("a/b c".as_bytes())), r#""a/b c""#);
        assert_eq!(&*name(&encode(b"\xff")), r#"b"\xff""#);
    }
}
