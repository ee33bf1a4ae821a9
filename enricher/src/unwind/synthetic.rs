//! Synthetic `.eh_frame` sections, for comparing the fast CFI walk with gimli's on
//! programs real binaries rarely carry (tests and the `cfi_program` fuzz target).

use super::build::{rows_of_eh_frame, BuildError, Table, Walk};

/// One CIE (augmentation `zR`, FDE addresses as 4-byte absolute values, return address in
/// register 16) with `cie_program`, then one FDE for each `(start, length, program)`.
pub fn eh_frame(caf: u64, daf: i64, cie_program: &[u8], fdes: &[(u32, u32, &[u8])]) -> Vec<u8> {
    let mut cie = vec![0, 0, 0, 0, 1, b'z', b'R', 0];
    // Writing to a Vec cannot fail.
    let _ = gimli::leb128::write::unsigned(&mut cie, caf);
    let _ = gimli::leb128::write::signed(&mut cie, daf);
    cie.extend_from_slice(&[16, 1, 0x03]);
    cie.extend_from_slice(cie_program);
    let mut out = Vec::new();
    entry(&mut out, &cie);
    for &(start, len, program) in fdes {
        // The CIE pointer counts back from its own field to the CIE.
        let back = u32::try_from(out.len() + 4).unwrap_or(u32::MAX);
        let mut fde = back.to_le_bytes().to_vec();
        fde.extend_from_slice(&start.to_le_bytes());
        fde.extend_from_slice(&len.to_le_bytes());
        fde.push(0);
        fde.extend_from_slice(program);
        entry(&mut out, &fde);
    }
    out
}

/// The table of a bare `.eh_frame` at address 0 (text at file offset 0).
pub fn build(eh_frame: &[u8], walk: Walk) -> Result<Table, BuildError> {
    rows_of_eh_frame(eh_frame, walk)
}

fn entry(out: &mut Vec<u8>, body: &[u8]) {
    // Padded with DW_CFA_nop to a multiple of 4, as assemblers do.
    let padded = body.len().div_ceil(4) * 4;
    let len = u32::try_from(padded).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(body);
    out.resize(out.len() + padded - body.len(), 0);
}
