//! What the BPF walk sends of Python frames: tagged user-stack entries, and the code
//! blobs (Batch.pythonCode) that name them, as the sampler forwards them unparsed and the
//! enricher decodes them.

/// Python frames in user stacks (the BPF walk's tagged entries).
pub mod frame {
    /// Bit 63 set, bit 62 clear: no user address has either bit, no kernel address
    /// has this pair.
    pub const TAG: u64 = 1 << 63;
    const TAG_MASK: u64 = 3 << 62;
    pub const INDEX_BITS: u32 = 20;
    pub const ID_MASK: u64 = (1 << 42) - 1;

    pub fn is_python(entry: u64) -> bool {
        entry & TAG_MASK == TAG
    }

    /// The code id and the instruction index (2-byte code units) of a Python frame.
    pub fn parts(entry: u64) -> (u64, u32) {
        (
            (entry >> INDEX_BITS) & ID_MASK,
            (entry & ((1 << INDEX_BITS) - 1)) as u32,
        )
    }
}

/// One code object's names as the BPF walk copied them (Batch.pythonCode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodeBlob<'a> {
    pub id: u64,
    pub first_line: u32,
    pub minor: u8,
    pub flags: u8,
    pub name: &'a [u8],
    pub file: &'a [u8],
    pub table: &'a [u8],
}

/// Header bytes of a code blob.
pub const CODE_HEADER_BYTES: usize = 24;
/// The walk's bounds on each part (profile.bpf.h's FIRN_PY_*_BYTES).
pub const CODE_NAME_BYTES: usize = 128;
pub const CODE_FILE_BYTES: usize = 256;
pub const CODE_TABLE_BYTES: usize = 3584;

/// Flags of a blob (profile.bpf.h's FIRN_PY_* flags).
pub mod code_flags {
    pub const NAME_CUT: u8 = 1;
    pub const FILE_CUT: u8 = 2;
    pub const TABLE_CUT: u8 = 4;
    pub const NOT_ASCII: u8 = 8;
    pub const NOT_STR: u8 = 16;
    pub const NOT_BYTES: u8 = 32;
}

impl<'a> CodeBlob<'a> {
    /// The wire form: the header, then the three parts.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(
            CODE_HEADER_BYTES + self.name.len() + self.file.len() + self.table.len(),
        );
        b.extend_from_slice(&self.id.to_le_bytes());
        b.extend_from_slice(&self.first_line.to_le_bytes());
        for part in [self.name, self.file, self.table] {
            b.extend_from_slice(&(part.len() as u16).to_le_bytes());
        }
        b.extend_from_slice(&[self.minor, self.flags, 0, 0, 0, 0]);
        b.extend_from_slice(self.name);
        b.extend_from_slice(self.file);
        b.extend_from_slice(self.table);
        b
    }

    /// Reads a blob; `None` when its lengths are over the walk's bounds or disagree
    /// with its size, or its reserved bytes are set.
    pub fn parse(b: &'a [u8]) -> Option<Self> {
        let head = b.get(..CODE_HEADER_BYTES)?;
        let u16_at = |i: usize| usize::from(u16::from_le_bytes([head[i], head[i + 1]]));
        let (n, f, t) = (u16_at(12), u16_at(14), u16_at(16));
        if n > CODE_NAME_BYTES
            || f > CODE_FILE_BYTES
            || t > CODE_TABLE_BYTES
            || head[20..].iter().any(|x| *x != 0)
            || b.len() != CODE_HEADER_BYTES + n + f + t
        {
            return None;
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&head[..8]);
        let id = u64::from_le_bytes(id);
        if id & !frame::ID_MASK != 0 {
            return None;
        }
        let body = &b[CODE_HEADER_BYTES..];
        Some(Self {
            id,
            first_line: u32::from_le_bytes([head[8], head[9], head[10], head[11]]),
            minor: head[18],
            flags: head[19],
            name: &body[..n],
            file: &body[n..n + f],
            table: &body[n + f..],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_round_trip_and_lies_are_refused() {
        let blob = CodeBlob {
            id: 42,
            first_line: 7,
            minor: 12,
            flags: code_flags::TABLE_CUT,
            name: b"K.method",
            file: b"/srv/app.py",
            table: &[1, 2, 3],
        };
        let b = blob.to_bytes();
        assert_eq!(CodeBlob::parse(&b), Some(blob.clone()));
        assert_eq!(CodeBlob::parse(&b[..b.len() - 1]), None, "short");
        let mut long = b.clone();
        long.push(0);
        assert_eq!(CodeBlob::parse(&long), None, "trailing bytes");
        let mut lie = b.clone();
        lie[12] = 200;
        assert_eq!(CodeBlob::parse(&lie), None, "name over its bound");
        let mut lie = b.clone();
        lie[7] = 0xff;
        assert_eq!(CodeBlob::parse(&lie), None, "id over 42 bits");
        let mut lie = b;
        lie[23] = 1;
        assert_eq!(CodeBlob::parse(&lie), None, "reserved");
        assert!(frame::is_python(frame::TAG | 42 << frame::INDEX_BITS | 5));
        assert_eq!(
            frame::parts(frame::TAG | 42 << frame::INDEX_BITS | 5),
            (42, 5)
        );
        assert!(!frame::is_python(0xffff_ffff_8100_0000));
        assert!(!frame::is_python(0x7fff_0000_0000));
    }
}
