//! Key encoding: how a key's bytes become the names of its files.
//!
//! A key is any `K: AsRef<[u8]>` (`&str`, `String`, `Vec<u8>`, `&[u8]`, ...).
//! Its bytes map to a file stem by a stable, reversible and therefore
//! collision-free rule:
//!
//! - the bytes `a`-`z`, `0`-`9`, `-` and `_` stand for themselves;
//! - every other byte (upper case letters, `.`, `/`, `%`, spaces, non-ASCII,
//!   NUL) becomes `%` and two upper case hex digits.
//!
//! The stem is prefixed with `key-`. Upper case letters are escaped so that
//! two keys differing only in case never share a file on a case-insensitive
//! file system; `.` is escaped so that no stem is `.`, `..` or hidden, and so
//! that the suffixes after the stem (`.state`) cannot be
//! confused with it. Decoding is the inverse, so two distinct keys always
//! name distinct files. No hashing is involved: an encoded stem longer than
//! [`MAX_ENCODED_KEY`] bytes is refused ([`ProcessLockError::Key`]), since
//! file names are limited to 255 bytes.
//!
//! [`ProcessLockError::Key`]: super::ProcessLockError::Key

use super::error::ProcessLockError;

/// The longest encoded key stem accepted, in bytes (the `key-` prefix
/// included). With the longest suffix the file name stays well under the
/// 255 bytes file systems allow. A key of plain lower case ASCII may be up
/// to 196 bytes; a key of arbitrary bytes at least 65.
pub const MAX_ENCODED_KEY: usize = 200;

const PREFIX: &str = "key-";

#[inline]
fn is_literal(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_'
}

/// The file stem of a key, or an error naming why it cannot be encoded.
pub(crate) fn encode(key: &[u8]) -> Result<String, ProcessLockError> {
    let len = PREFIX.len()
        + key
            .iter()
            .map(|&b| if is_literal(b) { 1 } else { 3 })
            .sum::<usize>();
    if len > MAX_ENCODED_KEY {
        return Err(ProcessLockError::Key {
            key_len: key.len(),
            encoded_len: len,
            max: MAX_ENCODED_KEY,
        });
    }
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(len);
    out.push_str(PREFIX);
    for &b in key {
        if is_literal(b) {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 15)] as char);
        }
    }
    Ok(out)
}

/// The key of `stem` as an error names it: `"k"` (its bytes as a string
/// when they are UTF-8, else escaped as `b"\xff"`), or the stem itself if
/// it is not one [`encode`] makes.
pub(crate) fn name(stem: &str) -> Box<str> {
    match decode(stem) {
        Some(bytes) => match std::str::from_utf8(&bytes) {
            Ok(text) => format!("{text:?}").into_boxed_str(),
            Err(_) => format!("b\"{}\"", bytes.escape_ascii()).into_boxed_str(),
        },
        None => stem.into(),
    }
}

/// The key bytes of a stem made by [`encode`], or `None` if `stem` is not
/// one.
pub(crate) fn decode(stem: &str) -> Option<Vec<u8>> {
    let rest = stem.strip_prefix(PREFIX)?.as_bytes();
    let mut out = Vec::with_capacity(rest.len());
    let mut i = 0;
    while i < rest.len() {
        let b = rest[i];
        if is_literal(b) {
            out.push(b);
            i += 1;
        } else if b == b'%' {
            let hex = std::str::from_utf8(rest.get(i + 1..i + 3)?).ok()?;
            if hex.bytes().any(|c| c.is_ascii_lowercase()) {
                return None;
            }
            let byte = u8::from_str_radix(hex, 16).ok()?;
            if is_literal(byte) {
                return None; // not canonical: `encode` never escapes these
            }
            out.push(byte);
            i += 3;
        } else {
            return None;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::{decode, encode, name, MAX_ENCODED_KEY};

    #[test]
    fn literal_bytes_stay_and_others_are_escaped() {
        assert_eq!(encode(b"invoice-17").unwrap(), "key-invoice-17");
        assert_eq!(encode(b"A.b/c%").unwrap(), "key-%41%2Eb%2Fc%25");
        assert_eq!(encode(b"").unwrap(), "key-");
        assert_eq!(encode(&[0, 255]).unwrap(), "key-%00%FF");
    }

    #[test]
    fn encoding_round_trips_so_distinct_keys_name_distinct_files() {
        let keys: Vec<Vec<u8>> = vec![
            b"a".to_vec(),
            b"A".to_vec(),
            b"%41".to_vec(),
            b"a.b".to_vec(),
            b"a%2Eb".to_vec(),
            vec![],
            vec![0],
            (0..=255u8).take(60).collect(),
            "ключ".as_bytes().to_vec(),
        ];
        let mut seen = std::collections::HashSet::new();
        for key in &keys {
            let stem = encode(key).unwrap();
            assert_eq!(decode(&stem).as_deref(), Some(key.as_slice()), "{stem}");
            assert!(seen.insert(stem.to_ascii_lowercase()), "{stem} collides");
            assert!(!stem.contains('.') && !stem.contains('/'));
        }
    }

    #[test]
    fn a_key_too_long_to_encode_is_refused_naming_the_lengths() {
        let long = vec![b'x'; MAX_ENCODED_KEY];
        let err = encode(&long).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(&MAX_ENCODED_KEY.to_string()), "{text}");
        assert!(encode(&[b'x'; MAX_ENCODED_KEY - 4]).is_ok());
        assert!(encode(&[b'.'; 66]).is_err());
        assert!(encode(&[b'.'; 65]).is_ok());
    }

    #[test]
    fn keys_are_named_as_given() {
        assert_eq!(&*name(&encode(b"k").unwrap()), r#""k""#);
        assert_eq!(&*name(&encode("a/b c".as_bytes()).unwrap()), r#""a/b c""#);
        assert_eq!(&*name(&encode(b"\xff\x00").unwrap()), r#"b"\xff\x00""#);
    }

    #[test]
    fn decode_refuses_what_encode_never_makes() {
        assert_eq!(decode("key-%61"), None); // 'a' escaped
        assert_eq!(decode("key-%2e"), None); // lower case hex
        assert_eq!(decode("key-%4"), None);
        assert_eq!(decode("key-A"), None);
        assert_eq!(decode("other"), None);
    }
}
