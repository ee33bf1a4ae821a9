//! Unwind tables kept on disk between runs, so that a restart, or a binary that ran
//! before, costs a file read instead of a CFI parse. Keyed by the binary's build id and
//! a SHA-256 of what the table is built from (the program headers and the CFI
//! sections, with firn's version): a build id is whatever its builder wrote, so a
//! crafted binary that borrows libc's gets an entry of its own, not libc's. Each entry
//! carries a digest of its rows
//! and is checked when read: a corrupt, truncated or stale entry is removed, counted and
//! built again, never sent. The sampler checks the rows as strictly whatever their
//! source. Bounded in bytes, and to a quarter of the disk the profiles leave free (they
//! come first); the least recently used entries go first.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Bumped whenever the table builder's output may change for the same binary.
const FORMAT: u32 = 1;
const MAGIC: &[u8; 8] = b"FIRNUWC1";
/// Magic, format, row count, SHA-256 of the rows.
const HEADER: usize = 8 + 4 + 4 + 32;
const ROW: usize = firn_schema::firn_capnp::UNWIND_ROW_BYTES as usize;

#[derive(Debug, thiserror::Error)]
pub(crate) enum CacheError {
    #[error("unwind table cache {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What a lookup found.
pub(crate) enum Found {
    /// The rows, as sent to the sampler.
    Rows(Vec<u8>),
    Missing,
    /// An entry that failed its check (removed).
    Corrupt,
}

struct Entry {
    bytes: u64,
    used: SystemTime,
}

pub(crate) struct Cache {
    dir: PathBuf,
    max_bytes: u64,
    /// Free space the profiles keep on the filesystem (`--min-free`).
    min_free: u64,
    bytes: u64,
    entries: HashMap<String, Entry>,
}

/// The cache key of a binary's bytes: `b-<build id>-<digest>` (`h-<digest>` without a
/// build id), the digest a SHA-256 of firn's version, the ELF header and program headers
/// and the CFI sections (`.eh_frame`, `.eh_frame_hdr`, `.debug_frame`): everything the
/// table is built from. A file that does not parse is digested whole.
pub(crate) fn key_of(map: &[u8]) -> String {
    use object::{Object, ObjectSection};
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(env!("CARGO_PKG_VERSION").as_bytes());
    ctx.update(&FORMAT.to_le_bytes());
    let parsed = crate::symbolize::contained(|| {
        let f = object::File::parse(map).ok()?;
        // The ELF header and program headers: the segments place the rows' offsets.
        let phdrs = match &f {
            object::File::Elf64(e) => {
                let (h, en) = (e.elf_header(), e.endian());
                let off = usize::try_from(h.e_phoff.get(en)).ok()?;
                let len = usize::from(h.e_phnum.get(en)) * usize::from(h.e_phentsize.get(en));
                map.get(..off.checked_add(len)?)?
            }
            _ => map.get(..64)?,
        };
        // The sections the builder reads: `.eh_frame` (and its header) when there is
        // one, else `.debug_frame`. Only those: reading a big `.debug_frame` the builder
        // skips would fault its pages in for nothing (they count in the enricher's RSS).
        let mut parts = vec![phdrs];
        let section = |name| f.section_by_name(name).and_then(|s| s.data().ok());
        match section(".eh_frame") {
            Some(eh) => {
                parts.push(eh);
                parts.extend(section(".eh_frame_hdr"));
            }
            None => parts.extend(section(".debug_frame")),
        }
        let id = f.build_id().ok().flatten().map(<[u8]>::to_vec);
        Some((parts, id))
    })
    .flatten();
    let Some((parts, id)) = parsed else {
        ctx.update(map);
        return format!("h-{}", hex(ctx.finish().as_ref()));
    };
    for p in parts {
        ctx.update(&(p.len() as u64).to_le_bytes());
        ctx.update(p);
    }
    let digest = hex(ctx.finish().as_ref());
    match id.filter(|id| !id.is_empty()) {
        Some(id) => format!("b-{}-{digest}", hex(&id)),
        None => format!("h-{digest}"),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn digest(rows: &[u8]) -> [u8; 32] {
    let mut d = [0; 32];
    d.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, rows).as_ref());
    d
}

/// The rows of an entry's bytes if it passes every check.
fn check(data: &[u8]) -> Option<&[u8]> {
    if data.len() < HEADER || &data[..8] != MAGIC {
        return None;
    }
    let word = |at: usize| u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
    let (format, rows) = (word(8), word(12) as usize);
    let body = &data[HEADER..];
    (format == FORMAT && body.len() == rows.checked_mul(ROW)? && digest(body)[..] == data[16..48])
        .then_some(body)
}

impl Cache {
    /// Opens (creating) `dir`, and learns what it holds; over `max_bytes`, the least
    /// recently used entries go now.
    pub(crate) fn open(dir: &Path, max_bytes: u64, min_free: u64) -> Result<Self, CacheError> {
        let io = |source| CacheError::Io {
            path: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let mut c = Self {
            dir: dir.to_path_buf(),
            max_bytes,
            min_free,
            bytes: 0,
            entries: HashMap::new(),
        };
        for e in std::fs::read_dir(dir).map_err(io)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(key) = name.strip_suffix(".tbl") else {
                // A write cut short by a crash, never renamed into place.
                if name.starts_with(".tmp-") {
                    let _ = std::fs::remove_file(e.path());
                }
                continue;
            };
            let Ok(m) = e.metadata() else { continue };
            let used = m.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            c.bytes += m.len();
            c.entries.insert(
                key.to_string(),
                Entry {
                    bytes: m.len(),
                    used,
                },
            );
        }
        let bound = c.bound();
        c.shrink(0, bound);
        Ok(c)
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.tbl"))
    }

    /// The rows kept for `key`, checked. A hit counts as a use (for eviction).
    pub(crate) fn get(&mut self, key: &str) -> Found {
        if !self.entries.contains_key(key) {
            return Found::Missing;
        }
        let path = self.path(key);
        let Ok(data) = std::fs::read(&path) else {
            self.remove(key);
            return Found::Missing;
        };
        match check(&data) {
            Some(rows) => {
                let now = SystemTime::now();
                if let Ok(f) = std::fs::File::options().write(true).open(&path) {
                    let _ = f.set_modified(now);
                }
                if let Some(e) = self.entries.get_mut(key) {
                    e.used = now;
                }
                Found::Rows(rows.to_vec())
            }
            None => {
                self.remove(key);
                Found::Corrupt
            }
        }
    }

    /// The bound now: `--unwind-cache-size`, and a quarter of what the filesystem has
    /// beyond the profiles' reserve (counting what the cache holds).
    fn bound(&self) -> u64 {
        match nix::sys::statvfs::statvfs(&self.dir) {
            Ok(st) => {
                let free = st.blocks_available().saturating_mul(st.fragment_size());
                let usable = (self.bytes + free).saturating_sub(self.min_free);
                self.max_bytes.min(usable / 4)
            }
            Err(_) => self.max_bytes,
        }
    }

    /// Keeps `rows` for `key` (written aside, then renamed into place), making room.
    /// Returns the entries evicted, or `None` when it does not fit the bound at all.
    pub(crate) fn put(&mut self, key: &str, rows: &[u8]) -> Result<Option<u64>, CacheError> {
        let size = (HEADER + rows.len()) as u64;
        let bound = self.bound();
        if size > bound || !rows.len().is_multiple_of(ROW) {
            return Ok(None);
        }
        // An entry of this key (rewritten) leaves the count, not the disk: the new file
        // takes its place.
        if let Some(old) = self.entries.remove(key) {
            self.bytes = self.bytes.saturating_sub(old.bytes);
        }
        let evicted = self.shrink(size, bound);
        let path = self.path(key);
        let tmp = self.dir.join(format!(".tmp-{key}"));
        let io = |source| CacheError::Io {
            path: path.clone(),
            source,
        };
        let n = u32::try_from(rows.len() / ROW).unwrap_or(u32::MAX);
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(MAGIC)?;
            f.write_all(&FORMAT.to_le_bytes())?;
            f.write_all(&n.to_le_bytes())?;
            f.write_all(&digest(rows))?;
            f.write_all(rows)?;
            std::fs::rename(&tmp, &path)
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(e));
        }
        self.bytes += size;
        self.entries.insert(
            key.to_string(),
            Entry {
                bytes: size,
                used: SystemTime::now(),
            },
        );
        Ok(Some(evicted))
    }

    fn remove(&mut self, key: &str) {
        if let Some(e) = self.entries.remove(key) {
            self.bytes = self.bytes.saturating_sub(e.bytes);
            let _ = std::fs::remove_file(self.path(key));
        }
    }

    /// Evicts the least recently used entries until `room` more bytes fit in `bound`.
    fn shrink(&mut self, room: u64, bound: u64) -> u64 {
        let mut evicted = 0;
        while self.bytes + room > bound {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            self.remove(&oldest);
            evicted += 1;
        }
        evicted
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, seed: u8) -> Vec<u8> {
        (0..n * ROW).map(|i| (i as u8).wrapping_mul(seed)).collect()
    }

    #[test]
    fn entries_come_back_checked_and_a_damaged_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("firn-uwc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut c = Cache::open(&dir, 1 << 20, 0).unwrap();
        c.put("b-01", &rows(100, 3)).unwrap();
        assert!(matches!(c.get("b-01"), Found::Rows(r) if r == rows(100, 3)));
        assert!(matches!(c.get("b-02"), Found::Missing));
        // Reopened: still there. Then one byte flipped, then cut short: refused, gone.
        let mut c = Cache::open(&dir, 1 << 20, 0).unwrap();
        assert_eq!(c.len(), 1);
        let path = dir.join("b-01.tbl");
        let mut data = std::fs::read(&path).unwrap();
        data[HEADER + 5] ^= 1;
        std::fs::write(&path, &data).unwrap();
        assert!(matches!(c.get("b-01"), Found::Corrupt));
        assert!(!path.exists() && c.len() == 0 && c.bytes() == 0);
        c.put("b-01", &rows(100, 3)).unwrap();
        let data = std::fs::read(&path).unwrap();
        std::fs::write(&path, &data[..data.len() - 8]).unwrap();
        assert!(matches!(c.get("b-01"), Found::Corrupt));
        // A stale format is refused the same way.
        c.put("b-01", &rows(10, 3)).unwrap();
        let mut data = std::fs::read(&path).unwrap();
        data[8] = 99;
        std::fs::write(&path, &data).unwrap();
        assert!(matches!(c.get("b-01"), Found::Corrupt));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_cache_keeps_to_its_bytes_least_recently_used_first() {
        let dir = std::env::temp_dir().join(format!("firn-uwc-lru-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let one = (HEADER + 1000 * ROW) as u64;
        let mut c = Cache::open(&dir, 3 * one, 0).unwrap();
        for k in ["b-1", "b-2", "b-3"] {
            c.put(k, &rows(1000, 5)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(matches!(c.get("b-1"), Found::Rows(_)), "b-1 used again");
        assert_eq!(c.put("b-4", &rows(1000, 5)).unwrap(), Some(1));
        assert!(
            matches!(c.get("b-2"), Found::Missing),
            "least recently used went"
        );
        assert!(matches!(c.get("b-1"), Found::Rows(_)));
        assert!(c.bytes() <= 3 * one && c.len() == 3);
        // Reopened with a smaller bound: shrinks at once.
        let c = Cache::open(&dir, one, 0).unwrap();
        assert!(c.bytes() <= one && c.len() == 1);
        // A reserve larger than the disk leaves the cache no room.
        let mut c = Cache::open(&dir, 3 * one, u64::MAX / 2).unwrap();
        assert_eq!(c.put("b-5", &rows(10, 5)).unwrap(), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn keys_are_build_ids_or_content_hashes() {
        let me = std::fs::read("/proc/self/exe").unwrap();
        let k = key_of(&me);
        assert!(k.starts_with("b-") && k.len() > 80, "{k}");
        assert!(key_of(b"not an elf").starts_with("h-"));
        assert_ne!(key_of(b"a"), key_of(b"b"));
        // One build id, other CFI: another key.
        use object::{Object, ObjectSection};
        let f = object::File::parse(&*me).unwrap();
        let (at, _) = f
            .section_by_name(".eh_frame")
            .unwrap()
            .file_range()
            .unwrap();
        let mut other = me.clone();
        other[at as usize + 40] ^= 1;
        let k2 = key_of(&other);
        assert_ne!(k, k2);
        assert_eq!(
            k.split('-').nth(1),
            k2.split('-').nth(1),
            "the same build id"
        );
    }
}
