//! The state file: versioned, self-describing, checksummed.
//!
//! ```text
//! magic    8 bytes  "AMVMSNAP"
//! version  u32 LE   FORMAT_VERSION (another is refused, never guessed at)
//! length   u64 LE   the body's length (at most MAX_BODY)
//! sha256   32 bytes of the body
//! body     JSON     (self-describing: `jq` reads it)
//! ```
//!
//! A snapshot directory is its owner's (0700, files 0600), but a file on disk can be truncated,
//! corrupted or someone else's: [`decode`] checks every field before the body is parsed, and
//! fails with what is wrong; it never panics (fuzzed: tests/fuzz `snapshot_state`).

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

pub const MAGIC: &[u8; 8] = b"AMVMSNAP";
pub const FORMAT_VERSION: u32 = 1;
pub const HEADER: usize = 8 + 4 + 8 + 32;
/// A machine's state is tens of KiB per vCPU; nothing legitimate comes near this.
pub const MAX_BODY: u64 = 64 << 20;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FormatError {
    #[error("not an amvm snapshot (no AMVMSNAP header)")]
    NotASnapshot,
    #[error("snapshot format {found}; this amvm reads format {supported}")]
    Version { found: u32, supported: u32 },
    #[error("truncated: {have} bytes where {need} were expected")]
    Truncated { have: u64, need: u64 },
    #[error("{0} bytes after the end of the state")]
    Trailing(u64),
    #[error("the state says it is {0} bytes, more than {MAX_BODY}")]
    TooLarge(u64),
    #[error("corrupted: its checksum does not match")]
    Checksum,
    #[error("malformed state: {0}")]
    Malformed(String),
}

/// `body` as a state file's bytes.
pub fn encode<T: Serialize>(body: &T) -> Result<Vec<u8>, FormatError> {
    let json = serde_json::to_vec(body).map_err(|e| FormatError::Malformed(e.to_string()))?;
    let mut out = Vec::with_capacity(HEADER + json.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(&json));
    out.extend_from_slice(&json);
    Ok(out)
}

/// The body of the state file `bytes`, checked.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, FormatError> {
    let have = bytes.len() as u64;
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err(FormatError::NotASnapshot);
    }
    if bytes.len() < HEADER {
        return Err(FormatError::Truncated {
            have,
            need: HEADER as u64,
        });
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(FormatError::Version {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    if len > MAX_BODY {
        return Err(FormatError::TooLarge(len));
    }
    let need = HEADER as u64 + len;
    if have < need {
        return Err(FormatError::Truncated { have, need });
    }
    if have > need {
        return Err(FormatError::Trailing(have - need));
    }
    let body = &bytes[HEADER..];
    if Sha256::digest(body).as_slice() != &bytes[20..HEADER] {
        return Err(FormatError::Checksum);
    }
    serde_json::from_slice(body).map_err(|e| FormatError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Body {
        a: u32,
        b: Vec<u8>,
    }

    #[test]
    fn a_state_round_trips_and_every_damage_is_named() {
        let body = Body {
            a: 7,
            b: vec![1, 2, 3],
        };
        let good = encode(&body).unwrap();
        assert_eq!(decode::<Body>(&good).unwrap(), body);

        assert_eq!(
            decode::<Body>(b"ELF\x7f").unwrap_err(),
            FormatError::NotASnapshot
        );
        assert_eq!(decode::<Body>(&[]).unwrap_err(), FormatError::NotASnapshot);
        for cut in [9, HEADER - 1, HEADER, good.len() - 1] {
            assert!(
                matches!(
                    decode::<Body>(&good[..cut]),
                    Err(FormatError::Truncated { .. })
                ),
                "cut at {cut}"
            );
        }
        let mut long = good.clone();
        long.push(b' ');
        assert_eq!(decode::<Body>(&long).unwrap_err(), FormatError::Trailing(1));
        let mut v2 = good.clone();
        v2[8] = 2;
        assert_eq!(
            decode::<Body>(&v2).unwrap_err(),
            FormatError::Version {
                found: 2,
                supported: 1
            }
        );
        let mut huge = good.clone();
        huge[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            decode::<Body>(&huge).unwrap_err(),
            FormatError::TooLarge(u64::MAX)
        );
        // One flipped bit anywhere in the body.
        for i in HEADER..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x10;
            assert_eq!(
                decode::<Body>(&bad).unwrap_err(),
                FormatError::Checksum,
                "byte {i}"
            );
        }
        // A body with a valid checksum that is not the state expected.
        let other = encode(&serde_json::json!({"a": "seven"})).unwrap();
        assert!(matches!(
            decode::<Body>(&other),
            Err(FormatError::Malformed(_))
        ));
    }
}
