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

/// Bytes hashed per read for a key: the file is read through the page cache into this
/// small buffer, never through the mapping (whose pages would count in the RSS).
const KEY_CHUNK: usize = 64 << 10;

/// The cache key of a brokered file: `b-<build id>-<digest>` (`h-<digest>` without a
/// build id), the digest a SHA-256 of firn's version, the ELF header, the program
/// headers and the CFI sections (`.eh_frame` and `.eh_frame_hdr`, else `.debug_frame`):
/// everything the table is built from. `None`: not cached (counted by the caller) when
/// the file is not a 64-bit ELF, or its CFI is named by no section (the builder finds it
/// through `PT_GNU_EH_FRAME` then, and the key could not tell two such files apart).
///
/// Only the headers are parsed from `map` (a few pages); the ranges are hashed with
/// `pread` from `file`. A BOLT-rewritten binary (rustc's `librustc_driver`) keeps its
/// program headers near its end, and a mapping read up to them faulted ~90–140 MiB of
/// the file into the enricher's RSS.
pub(crate) fn key_of(file: &std::fs::File, map: &[u8]) -> Option<String> {
    use object::read::elf::ElfFile64;
    use object::{Object, ObjectSection};
    let (ranges, id) = crate::symbolize::contained(|| {
        let f = ElfFile64::<object::Endianness>::parse(map).ok()?;
        let (h, en) = (f.elf_header(), f.endian());
        let phoff = h.e_phoff.get(en);
        let phlen = u64::from(h.e_phnum.get(en)) * u64::from(h.e_phentsize.get(en));
        let header = std::mem::size_of_val(h) as u64;
        let mut ranges = vec![(0, header), (phoff, phlen)];
        let range = |name| f.section_by_name(name).and_then(|s| s.file_range());
        match range(".eh_frame") {
            Some(eh) => {
                ranges.push(eh);
                ranges.extend(range(".eh_frame_hdr"));
            }
            None => ranges.push(range(".debug_frame")?),
        }
        let id = f.build_id().ok().flatten().map(<[u8]>::to_vec);
        Some((ranges, id))
    })
    .flatten()?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(env!("CARGO_PKG_VERSION").as_bytes());
    ctx.update(&FORMAT.to_le_bytes());
    let mut buf = vec![0u8; KEY_CHUNK];
    for (at, len) in ranges {
        ctx.update(&len.to_le_bytes());
        digest_range(file, &mut ctx, &mut buf, at, len).ok()?;
    }
    let digest = hex(ctx.finish().as_ref());
    Some(match id.filter(|id| !id.is_empty()) {
        Some(id) => format!("b-{}-{digest}", hex(&id)),
        None => format!("h-{digest}"),
    })
}

/// Hashes `len` bytes of `file` from `at`, read through `buf`.
fn digest_range(
    file: &std::fs::File,
    ctx: &mut ring::digest::Context,
    buf: &mut [u8],
    at: u64,
    len: u64,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut done = 0;
    while done < len {
        let n = buf
            .len()
            .min(usize::try_from(len - done).unwrap_or(usize::MAX));
        // A range past the file's end fails here (UnexpectedEof): no key.
        file.read_exact_at(&mut buf[..n], at + done)?;
        ctx.update(&buf[..n]);
        done += n as u64;
    }
    Ok(())
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

    /// The rows kept for `key`, checked. A hit counts as a use (for eviction). The
    /// rows are the file's bytes with the header taken off in place: one buffer.
    pub(crate) fn get(&mut self, key: &str) -> Found {
        if !self.entries.contains_key(key) {
            return Found::Missing;
        }
        let path = self.path(key);
        let Ok(mut data) = std::fs::read(&path) else {
            self.remove(key);
            return Found::Missing;
        };
        if check(&data).is_none() {
            self.remove(key);
            return Found::Corrupt;
        }
        let now = SystemTime::now();
        if let Ok(f) = std::fs::File::options().write(true).open(&path) {
            let _ = f.set_modified(now);
        }
        if let Some(e) = self.entries.get_mut(key) {
            e.used = now;
        }
        data.drain(..HEADER);
        Found::Rows(data)
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
        let dir = std::env::temp_dir().join(format!("firn-uwc-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let key = |name: &str, bytes: &[u8]| {
            let path = dir.join(name);
            std::fs::write(&path, bytes).unwrap();
            let f = std::fs::File::open(&path).unwrap();
            // SAFETY: a private read-only mapping of a file this test alone writes.
            let map = unsafe { memmap2::Mmap::map(&f).unwrap() };
            key_of(&f, &map)
        };
        let me = std::fs::read("/proc/self/exe").unwrap();
        let k = key("me", &me).expect("an ELF file with CFI has a key");
        assert!(k.starts_with("b-") && k.len() > 80, "{k}");
        assert_eq!(key("me", &me).as_deref(), Some(&*k), "stable");
        assert_eq!(key("text", b"not an elf"), None, "not cached");
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
        let k2 = key("other", &other).unwrap();
        assert_ne!(k, k2);
        assert_eq!(
            k.split('-').nth(1),
            k2.split('-').nth(1),
            "the same build id"
        );
        // Cut short inside its CFI: no key (the range is not all there).
        assert_eq!(key("cut", &me[..at as usize + 100]), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
