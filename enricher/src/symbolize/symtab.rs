//! A round's names from a binary's symbol tables, read in one pass through a small
//! buffer, for a parse that is not kept. blazesym would map the tables and index every
//! symbol (a third of their size on the heap) to answer a few addresses and drop it
//! all: under a Rust build, rustc's libLLVM and librustc_driver (26 MiB of tables
//! each) put the enricher ~35 MiB over its steady size for each round that met them.
//!
//! The answer is blazesym's own (its tests hold it to that): among the symbols of the
//! nearest address at or below the one asked (functions, objects and untyped ones),
//! the largest that covers it, else a sizeless one (in `.dynsym`, only at its exact
//! address); `.symtab` first, then `.dynsym`; names demangled the same way.

use std::os::fd::BorrowedFd;
use std::sync::Arc;

use super::debug_file::DebugFile;
use super::elf::{address_of, Segment};
use crate::model::{Line, Lines};

/// Where a symbol table and its string table lie in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Table {
    pub(super) syms: (u64, u64),
    pub(super) strs: (u64, u64),
}

/// A 64-bit ELF file's symbol tables (other files are left to blazesym).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Tables {
    pub(super) symtab: Option<Table>,
    pub(super) dynsym: Option<Table>,
}

const SYM_SIZE: usize = 24;
/// Symbols read a time (64 KiB less a few bytes).
const CHUNK: usize = 2730 * SYM_SIZE;
/// Longest name read; a longer one is left unnamed.
const NAME_MAX: usize = 64 * 1024;
const SHN_UNDEF: u16 = 0;
const STT_NOTYPE: u8 = 0;
const STT_OBJECT: u8 = 1;
const STT_FUNC: u8 = 2;
const STT_GNU_IFUNC: u8 = 10;

#[derive(Debug, thiserror::Error)]
pub(super) enum ScanError {
    #[error("reading the symbol table: {0}")]
    Read(#[from] nix::Error),
}

/// A symbol that may answer: its name's offset in the string table and its size.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    name: u32,
    size: u64,
}

/// What one pass found for the nearest symbol address at or below an address.
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    value: Option<u64>,
    /// The largest sized symbol there that may answer (the first of equal ones).
    sized: Option<Candidate>,
    /// The first sizeless one.
    sizeless: Option<Candidate>,
}

impl Slot {
    fn offer(&mut self, value: u64, c: Option<Candidate>) {
        match self.value {
            Some(v) if v > value => return,
            Some(v) if v == value => {}
            _ => {
                *self = Slot {
                    value: Some(value),
                    ..Slot::default()
                }
            }
        }
        let Some(c) = c else { return };
        if c.size == 0 {
            self.sizeless = self.sizeless.or(Some(c));
        } else if self.sized.is_none_or(|s| c.size > s.size) {
            self.sized = Some(c);
        }
    }

    fn merge(&mut self, other: &Slot) {
        let Some(value) = other.value else { return };
        self.offer(value, other.sized);
        self.offer(value, other.sizeless);
    }

    fn answer(&self, addr: u64, dynamic: bool) -> Option<(u64, Candidate)> {
        let value = self.value?;
        let sized = self.sized.filter(|s| addr - value < s.size);
        let sizeless = || self.sizeless.filter(|_| !dynamic || addr == value);
        Some((value, sized.or_else(sizeless)?))
    }
}

/// A binary's names as [`super::debug_file::lookup`] finds them without DWARF: its
/// separate debug file's by address, then its own.
pub(super) struct Scan<'a> {
    tables: &'a Tables,
    loads: &'a [Segment],
    debug: Option<(BorrowedFd<'a>, &'a Tables)>,
}

impl<'a> Scan<'a> {
    /// None when a file is not one the scan reads (then blazesym does).
    pub(super) fn of(
        tables: &'a Tables,
        loads: &'a [Segment],
        debug: Option<&'a DebugFile>,
    ) -> Option<Self> {
        let debug = match debug {
            Some(d) => Some((d.fd(), d.tables.as_ref()?)),
            None => None,
        };
        Some(Self {
            tables,
            loads,
            debug,
        })
    }

    /// Names for file offsets `misses` of the binary `fd`.
    pub(super) fn lookup(
        &self,
        fd: BorrowedFd<'_>,
        misses: &[u64],
    ) -> Result<Vec<Option<Lines>>, ScanError> {
        let addrs: Vec<Option<u64>> = misses.iter().map(|&o| address_of(self.loads, o)).collect();
        let mut out = vec![None; misses.len()];
        let files = self.debug.into_iter().chain([(fd, self.tables)]);
        for (file, tables) in files {
            let (at, asked): (Vec<usize>, Vec<u64>) = addrs
                .iter()
                .enumerate()
                .filter(|&(i, _)| out[i].is_none())
                .filter_map(|(i, a)| Some((i, (*a)?)))
                .unzip();
            if asked.is_empty() {
                break;
            }
            for (i, lines) in at.into_iter().zip(names(file, tables, &asked)?) {
                out[i] = lines;
            }
        }
        Ok(out)
    }
}

/// Names for `addrs` (virtual addresses, any order) from `tables` of the file `fd`.
fn names(
    fd: BorrowedFd<'_>,
    tables: &Tables,
    addrs: &[u64],
) -> Result<Vec<Option<Lines>>, ScanError> {
    let mut out = vec![None; addrs.len()];
    for (table, dynamic) in [(tables.symtab, false), (tables.dynsym, true)] {
        let Some(table) = table else { continue };
        let open: Vec<usize> = (0..addrs.len()).filter(|&i| out[i].is_none()).collect();
        if open.is_empty() {
            break;
        }
        let asked: Vec<u64> = open.iter().map(|&i| addrs[i]).collect();
        for (i, found) in open.into_iter().zip(scan(fd, table, &asked, dynamic)?) {
            out[i] = found
                .and_then(|(_, c)| read_name(fd, table.strs, c.name))
                .map(|f| {
                    Arc::from(vec![Line {
                        function: Arc::from(demangled(&f).as_str()),
                        file: Arc::from(""),
                        line: 0,
                    }])
                });
        }
    }
    Ok(out)
}

/// The symbol (its address, name and size) answering each of `addrs` in one table, in
/// one pass: each symbol
/// goes to the slot of the lowest address at or above its own; the nearest symbol
/// address below an address is then the greatest among its slot and those before.
fn scan(
    fd: BorrowedFd<'_>,
    table: Table,
    addrs: &[u64],
    dynamic: bool,
) -> Result<Vec<Option<(u64, Candidate)>>, ScanError> {
    let mut order: Vec<usize> = (0..addrs.len()).collect();
    order.sort_unstable_by_key(|&i| addrs[i]);
    let sorted: Vec<u64> = order.iter().map(|&i| addrs[i]).collect();
    let mut slots = vec![Slot::default(); sorted.len()];
    let (start, len) = table.syms;
    let count = len / SYM_SIZE as u64;
    let mut buf = vec![0u8; CHUNK];
    let mut at = 0u64;
    while at < count {
        let want = usize::try_from((count - at).min((CHUNK / SYM_SIZE) as u64)).unwrap_or(0);
        let bytes = want * SYM_SIZE;
        let got = read_exact_at(
            fd,
            &mut buf[..bytes],
            start.saturating_add(at * SYM_SIZE as u64),
        )?;
        if got < bytes {
            break;
        }
        for sym in buf[..bytes].chunks_exact(SYM_SIZE) {
            let kind = sym[4] & 0xf;
            if !matches!(kind, STT_NOTYPE | STT_OBJECT | STT_FUNC | STT_GNU_IFUNC) {
                continue;
            }
            let value = u64::from_ne_bytes(sym[8..16].try_into().unwrap_or_default());
            let j = sorted.partition_point(|&a| a < value);
            let Some(slot) = slots.get_mut(j) else {
                continue;
            };
            let shndx = u16::from_ne_bytes([sym[6], sym[7]]);
            let candidate = (shndx != SHN_UNDEF).then(|| Candidate {
                name: u32::from_ne_bytes(sym[0..4].try_into().unwrap_or_default()),
                size: u64::from_ne_bytes(sym[16..24].try_into().unwrap_or_default()),
            });
            slot.offer(value, candidate);
        }
        at += want as u64;
    }
    let mut out = vec![None; addrs.len()];
    let mut nearest = Slot::default();
    for (k, slot) in slots.iter().enumerate() {
        nearest.merge(slot);
        out[order[k]] = nearest.answer(sorted[k], dynamic);
    }
    Ok(out)
}

/// Reads until `buf` is full or the file ends.
fn read_exact_at(fd: BorrowedFd<'_>, buf: &mut [u8], offset: u64) -> Result<usize, ScanError> {
    let mut done = 0;
    while done < buf.len() {
        let at = i64::try_from(offset.saturating_add(done as u64)).unwrap_or(i64::MAX);
        match nix::sys::uio::pread(fd, &mut buf[done..], at) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(nix::Error::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(done)
}

/// The NUL-ended UTF-8 name at `name` in the string table `strs`.
fn read_name(fd: BorrowedFd<'_>, strs: (u64, u64), name: u32) -> Option<String> {
    let (start, len) = strs;
    let name = u64::from(name);
    if name >= len {
        return None;
    }
    let most = usize::try_from((len - name).min(NAME_MAX as u64)).ok()?;
    let mut buf = vec![0u8; most.min(256)];
    loop {
        let got = read_exact_at(fd, &mut buf, start.saturating_add(name)).ok()?;
        if let Some(end) = buf[..got].iter().position(|&b| b == 0) {
            buf.truncate(end);
            return String::from_utf8(buf).ok();
        }
        if got < buf.len() || buf.len() == most {
            return None;
        }
        buf.resize((buf.len() * 4).min(most), 0);
    }
}

/// As blazesym names a symbol of no known language: Rust's mangling, then C++'s.
fn demangled(name: &str) -> String {
    if let Ok(d) = rustc_demangle::try_demangle(name) {
        return format!("{d:#}");
    }
    cpp_demangle::Symbol::new(name)
        .ok()
        .and_then(|s| s.demangle().ok())
        .unwrap_or_else(|| name.to_string())
}

#[cfg(test)]
#[path = "symtab_tests.rs"]
mod tests;
