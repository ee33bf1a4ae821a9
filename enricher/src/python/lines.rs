//! Line numbers from a code object's line table, as CPython itself computes them
//! (`PyCode_Addr2Line`). The bytes come from a process through BPF, so they are not
//! trusted: every decoder is bounded by the input's length and never panics.

/// Largest table decoded (CPython's own are a few KiB at most; BPF copies less).
pub const MAX_TABLE: usize = 64 * 1024;

/// The table's format, by version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// 3.10 `co_linetable`: (bytecode delta, signed line delta) byte pairs.
    Pairs,
    /// 3.11 on: the location table (`Objects/locations.md` in CPython).
    Locations,
}

impl Format {
    pub fn of_minor(minor: u8) -> Option<Self> {
        match minor {
            10 => Some(Self::Pairs),
            11.. => Some(Self::Locations),
            _ => None,
        }
    }
}

/// The line of the instruction at `byte_offset` (bytes into the bytecode), or `None`
/// where the table says the instruction has no line or does not reach that far.
pub fn line_at(format: Format, table: &[u8], first_line: i32, byte_offset: u32) -> Option<u32> {
    let table = table.get(..table.len().min(MAX_TABLE))?;
    let mut ranges = Ranges {
        format,
        table,
        at: 0,
        end: 0,
        line: i64::from(first_line),
    };
    while let Some((start, end, line)) = ranges.next() {
        if (start..end).contains(&u64::from(byte_offset)) {
            return line.and_then(|l| u32::try_from(l).ok()).filter(|l| *l > 0);
        }
        if start > u64::from(byte_offset) {
            return None;
        }
    }
    None
}

/// Every (start, end, line) range of a table, as `code.co_lines()` yields them (empty
/// ranges skipped): for the tests that compare with CPython, and for whole-table uses.
pub fn ranges(format: Format, table: &[u8], first_line: i32) -> Vec<(u64, u64, Option<i64>)> {
    let table = &table[..table.len().min(MAX_TABLE)];
    let mut r = Ranges {
        format,
        table,
        at: 0,
        end: 0,
        line: i64::from(first_line),
    };
    std::iter::from_fn(|| r.next()).collect()
}

struct Ranges<'a> {
    format: Format,
    table: &'a [u8],
    at: usize,
    /// Bytes of bytecode covered so far.
    end: u64,
    /// The running line (`computed_line` in CPython).
    line: i64,
}

impl Ranges<'_> {
    /// The next non-empty range. Each call consumes at least one byte of the table.
    fn next(&mut self) -> Option<(u64, u64, Option<i64>)> {
        loop {
            let (len, line) = match self.format {
                Format::Pairs => self.pair()?,
                Format::Locations => self.location()?,
            };
            let start = self.end;
            self.end += len;
            if len > 0 {
                return Some((start, self.end, line));
            }
        }
    }

    fn pair(&mut self) -> Option<(u64, Option<i64>)> {
        let &[delta, line_delta] = self.table.get(self.at..self.at + 2)? else {
            return None;
        };
        self.at += 2;
        let line_delta = i8::from_le_bytes([line_delta]);
        if line_delta == -128 {
            return Some((u64::from(delta), None));
        }
        self.line += i64::from(line_delta);
        Some((u64::from(delta), Some(self.line)))
    }

    fn location(&mut self) -> Option<(u64, Option<i64>)> {
        let first = *self.table.get(self.at)?;
        let code = (first >> 3) & 15;
        // Code units (two bytes each).
        let len = (u64::from(first & 7) + 1) * 2;
        let delta = match code {
            13 | 14 => signed_varint(self.table.get(self.at + 1..).unwrap_or_default()),
            10..=12 => i64::from(code - 10),
            _ => 0,
        };
        // The entry's other bytes are the ones without the high bit.
        self.at += 1;
        while self.table.get(self.at).is_some_and(|b| b & 0x80 == 0) {
            self.at += 1;
        }
        if code == 15 {
            return Some((len, None));
        }
        self.line = self.line.saturating_add(delta);
        Some((len, Some(self.line)))
    }
}

/// 6-bit chunks, bit 6 set on all but the last; the sign in the lowest bit. Stops at the
/// slice's end and after 10 chunks (a value beyond 60 bits is garbage either way).
fn signed_varint(b: &[u8]) -> i64 {
    let mut value: u64 = 0;
    for (i, byte) in b.iter().take(10).enumerate() {
        value |= u64::from(byte & 63) << (6 * i);
        if byte & 64 == 0 {
            break;
        }
    }
    let magnitude = i64::try_from(value >> 1).unwrap_or(i64::MAX);
    if value & 1 == 1 {
        -magnitude
    } else {
        magnitude
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_follow_cpython_310() {
        // def f():\n  x = 1\n  return x   (firstlineno 1): 4 bytes line 2, 4 bytes line 3.
        let table = [4u8, 1, 4, 1];
        assert_eq!(line_at(Format::Pairs, &table, 1, 0), Some(2));
        assert_eq!(line_at(Format::Pairs, &table, 1, 6), Some(3));
        assert_eq!(line_at(Format::Pairs, &table, 1, 8), None);
        // An entry without a line.
        assert_eq!(line_at(Format::Pairs, &[2, 0x80], 5, 0), None);
    }

    #[test]
    fn locations_decode_every_form() {
        // One-line form +1 (code 11), length 1 unit, two column bytes.
        let mut t = vec![0x80 | (11 << 3), 0, 4];
        // No-columns form (13) with delta -1 (varint 3), length 2 units.
        t.extend([0x80 | (13 << 3) | 1, 3]);
        // Long form (14) with delta +5 (varint 10), then end line, columns.
        t.extend([0x80 | (14 << 3), 10, 0, 1, 2]);
        // No location (15).
        t.push(0x80 | (15 << 3));
        assert_eq!(line_at(Format::Locations, &t, 10, 0), Some(11));
        assert_eq!(line_at(Format::Locations, &t, 10, 2), Some(10));
        assert_eq!(line_at(Format::Locations, &t, 10, 4), Some(10));
        assert_eq!(line_at(Format::Locations, &t, 10, 6), Some(15));
        assert_eq!(line_at(Format::Locations, &t, 10, 8), None);
        assert_eq!(line_at(Format::Locations, &t, 10, 10), None);
    }

    #[test]
    fn garbage_never_panics() {
        for seed in 0u32..2000 {
            let table: Vec<u8> = (0..(seed % 97))
                .map(|i| (seed.wrapping_mul(2_654_435_761).wrapping_add(i * 40503) >> 7) as u8)
                .collect();
            for f in [Format::Pairs, Format::Locations] {
                let _ = line_at(f, &table, i32::MAX, seed);
                let _ = line_at(f, &table, i32::MIN, seed);
                assert!(ranges(f, &table, 0).len() <= table.len());
            }
        }
    }
}
