//! A CFI program evaluator that keeps only what a table row needs: the CFA rule and the
//! rules of the return address and rbp.
//!
//! gimli's `UnwindTable` keeps every register's rule in each row, copies whole rows on
//! `remember_state` and replays the CIE's program before each FDE: about half of a table
//! build. This evaluates each CIE once (decoded by gimli) and each FDE's program with a
//! decoder of its own that yields gimli's instructions, on a state of a few words. It
//! gives up on a program (`Bail`) wherever gimli would fail or where it does not model
//! an instruction or a header; the caller then builds that FDE with gimli, so the rows
//! are gimli's in every case. Identity with gimli is tested over every ELF file of a
//! machine, against tables earlier builds cached, on synthetic sections and by fuzzing.

use gimli::{
    CallFrameInstruction as I, CallFrameInstructionIter, EndianSlice, LittleEndian, Reader,
    Register, UnwindExpression,
};

/// x86_64 DWARF registers kept.
pub(super) const RBP: u16 = 6;
pub(super) const RA: u16 = 16;
/// Rules of registers below this are tracked as a set (the CIE's, for `restore` and for
/// gimli's stack depth); a rule for any other register bails. With at most 64 distinct
/// registers, gimli's 64-rule limit is never reached on a program that does not bail.
const TRACKED: u16 = 64;
/// gimli's stack holds 4 rows (build.rs's `Storage`).
const STACK_ROWS: usize = 4;

/// A register's rule, as far as a table row tells them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rule {
    /// No rule: the register keeps its value.
    Default,
    Undefined,
    Same,
    /// Saved at CFA + offset.
    Offset(i64),
    /// Any other rule (register, expression, value rules).
    Other,
}

impl Rule {
    pub(super) fn of<T: gimli::ReaderOffset>(r: Option<gimli::RegisterRule<T>>) -> Rule {
        match r {
            None => Rule::Default,
            Some(gimli::RegisterRule::Undefined) => Rule::Undefined,
            Some(gimli::RegisterRule::SameValue) => Rule::Same,
            Some(gimli::RegisterRule::Offset(o)) => Rule::Offset(o),
            Some(_) => Rule::Other,
        }
    }
}

/// The CFA rule: a register and an offset, or an expression (`Some(n)` when it is the
/// PLT's, with its threshold `n`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cfa {
    Reg(u16, i64),
    Expr(Option<u16>),
}

/// One row's rules, and (for a CIE) which registers have a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct State {
    pub(super) cfa: Cfa,
    pub(super) ra: Rule,
    pub(super) rbp: Rule,
    regs: u64,
}

impl State {
    /// gimli's default row.
    const EMPTY: State = State {
        cfa: Cfa::Reg(0, 0),
        ra: Rule::Default,
        rbp: Rule::Default,
        regs: 0,
    };

    /// A row's rules as gimli gives them (the set of registers is not needed there).
    pub(super) fn of(cfa: Cfa, ra: Rule, rbp: Rule) -> State {
        State {
            cfa,
            ra,
            rbp,
            regs: 0,
        }
    }

    fn set(&mut self, register: Register, rule: Rule) -> Result<(), Bail> {
        if register.0 >= TRACKED {
            return Err(Bail);
        }
        self.regs |= 1 << register.0;
        match register.0 {
            RA => self.ra = rule,
            RBP => self.rbp = rule,
            _ => {}
        }
        Ok(())
    }
}

/// The program leaves what this evaluator models, or gimli would fail on it.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Bail;

/// A CIE's initial rules, evaluated once for all its FDEs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cie {
    init: State,
    /// Rows on gimli's stack before the FDE's program: a CIE with two rules or more
    /// keeps a copy of its row under the current one.
    base_rows: usize,
    caf: u64,
    daf: i64,
    /// The size of each of an FDE's two addresses, and whether augmentation data
    /// follows them: where its program starts.
    pointers: usize,
    augmented: bool,
}

/// An FDE's program: its bytes and their offset in the section.
#[derive(Debug, Clone, Copy)]
pub(super) struct Program<'a> {
    bytes: &'a [u8],
    at: usize,
}

/// The program of the FDE at `offset` in `section`, from the layout of its header
/// (gimli keeps the program's bytes to itself). `None` for 64-bit DWARF entries.
pub(super) fn program<'a>(section: &'a [u8], offset: usize, cie: &Cie) -> Option<Program<'a>> {
    let entry = section.get(offset..)?;
    let length = u32::from_le_bytes(entry.get(..4)?.try_into().ok()?);
    if length == u32::MAX {
        return None;
    }
    let entry = entry.get(..4 + usize::try_from(length).ok()?)?;
    // Length, CIE pointer, initial location, address range.
    let mut at = 8 + 2 * cie.pointers;
    if cie.augmented {
        let mut p = Program {
            bytes: entry.get(at..)?,
            at: 0,
        };
        let len = usize::try_from(p.uleb().ok()?).ok()?;
        at = at.checked_add(p.at)?.checked_add(len)?;
    }
    Some(Program {
        bytes: entry.get(at..)?,
        at: offset + at,
    })
}

impl<'a> Program<'a> {
    fn byte(&mut self) -> Result<u8, Bail> {
        let b = *self.bytes.first().ok_or(Bail)?;
        self.bytes = &self.bytes[1..];
        self.at += 1;
        Ok(b)
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], Bail> {
        let (head, rest) = self.bytes.split_first_chunk::<N>().ok_or(Bail)?;
        self.bytes = rest;
        self.at += N;
        Ok(*head)
    }

    /// A LEB128 read by gimli's own decoder, so that what decodes and what fails are
    /// exactly as in gimli's walk.
    #[inline(always)]
    fn leb<T>(
        &mut self,
        read: impl FnOnce(&mut EndianSlice<'a, LittleEndian>) -> gimli::Result<T>,
    ) -> Result<T, Bail> {
        let mut r = EndianSlice::new(self.bytes, LittleEndian);
        let v = read(&mut r).map_err(|_| Bail)?;
        self.at += self.bytes.len() - r.len();
        self.bytes = r.slice();
        Ok(v)
    }

    #[inline(always)]
    fn uleb(&mut self) -> Result<u64, Bail> {
        self.leb(gimli::leb128::read::unsigned)
    }

    #[inline(always)]
    fn sleb(&mut self) -> Result<i64, Bail> {
        self.leb(gimli::leb128::read::signed)
    }

    fn register(&mut self) -> Result<Register, Bail> {
        match self.uleb()? {
            r if r < u64::from(TRACKED) => Ok(Register(r as u16)),
            _ => Err(Bail),
        }
    }

    fn expression(&mut self) -> Result<UnwindExpression<usize>, Bail> {
        let length = usize::try_from(self.uleb()?).map_err(|_| Bail)?;
        let offset = self.at;
        self.bytes = self.bytes.get(length..).ok_or(Bail)?;
        self.at += length;
        Ok(UnwindExpression { offset, length })
    }

    /// The next instruction as gimli decodes it, for those the walk evaluates.
    #[inline(always)]
    fn next(&mut self) -> Result<Option<I<usize>>, Bail> {
        let Some(&op) = self.bytes.first() else {
            return Ok(None);
        };
        self.byte()?;
        let low = op & 0x3f;
        Ok(Some(match op >> 6 {
            1 => I::AdvanceLoc {
                delta: u32::from(low),
            },
            2 => I::Offset {
                register: Register(low.into()),
                factored_offset: self.uleb()?,
            },
            3 => I::Restore {
                register: Register(low.into()),
            },
            _ => match op {
                0x00 => I::Nop,
                0x02 => I::AdvanceLoc {
                    delta: u32::from(self.byte()?),
                },
                0x03 => I::AdvanceLoc {
                    delta: u32::from(u16::from_le_bytes(self.take()?)),
                },
                0x04 => I::AdvanceLoc {
                    delta: u32::from_le_bytes(self.take()?),
                },
                0x05 => I::Offset {
                    register: self.register()?,
                    factored_offset: self.uleb()?,
                },
                0x06 => I::Restore {
                    register: self.register()?,
                },
                0x07 => I::Undefined {
                    register: self.register()?,
                },
                0x08 => I::SameValue {
                    register: self.register()?,
                },
                0x09 => I::Register {
                    dest_register: self.register()?,
                    src_register: Register(u16::try_from(self.uleb()?).map_err(|_| Bail)?),
                },
                0x0a => I::RememberState,
                0x0b => I::RestoreState,
                0x0c => I::DefCfa {
                    register: Register(u16::try_from(self.uleb()?).map_err(|_| Bail)?),
                    offset: self.uleb()?,
                },
                0x0d => I::DefCfaRegister {
                    register: Register(u16::try_from(self.uleb()?).map_err(|_| Bail)?),
                },
                0x0e => I::DefCfaOffset {
                    offset: self.uleb()?,
                },
                0x0f => I::DefCfaExpression {
                    expression: self.expression()?,
                },
                0x10 => I::Expression {
                    register: self.register()?,
                    expression: self.expression()?,
                },
                0x11 => I::OffsetExtendedSf {
                    register: self.register()?,
                    factored_offset: self.sleb()?,
                },
                0x12 => I::DefCfaSf {
                    register: Register(u16::try_from(self.uleb()?).map_err(|_| Bail)?),
                    factored_offset: self.sleb()?,
                },
                0x13 => I::DefCfaOffsetSf {
                    factored_offset: self.sleb()?,
                },
                0x14 => I::ValOffset {
                    register: self.register()?,
                    factored_offset: self.uleb()?,
                },
                0x15 => I::ValOffsetSf {
                    register: self.register()?,
                    factored_offset: self.sleb()?,
                },
                0x16 => I::ValExpression {
                    register: self.register()?,
                    expression: self.expression()?,
                },
                0x2e => I::ArgsSize { size: self.uleb()? },
                // set_loc and anything else: gimli's.
                _ => return Err(Bail),
            },
        }))
    }
}

/// What each instruction does to the state; `None` for the instructions that end a row
/// or move the stack, which the caller handles.
fn apply<T: gimli::ReaderOffset>(
    s: &mut State,
    i: &I<T>,
    daf: i64,
    plt: &impl Fn(UnwindExpression<T>) -> Option<u16>,
) -> Option<Result<(), Bail>> {
    let d = |f: i64| f.wrapping_mul(daf);
    Some(match *i {
        I::Nop | I::ArgsSize { .. } => Ok(()),
        I::DefCfa { register, offset } => {
            s.cfa = Cfa::Reg(register.0, offset as i64);
            Ok(())
        }
        I::DefCfaSf {
            register,
            factored_offset,
        } => {
            s.cfa = Cfa::Reg(register.0, d(factored_offset));
            Ok(())
        }
        I::DefCfaRegister { register } => match s.cfa {
            Cfa::Reg(_, o) => {
                s.cfa = Cfa::Reg(register.0, o);
                Ok(())
            }
            Cfa::Expr(_) => Err(Bail),
        },
        I::DefCfaOffset { offset } => match s.cfa {
            Cfa::Reg(r, _) => {
                s.cfa = Cfa::Reg(r, offset as i64);
                Ok(())
            }
            Cfa::Expr(_) => Err(Bail),
        },
        I::DefCfaOffsetSf { factored_offset } => match s.cfa {
            Cfa::Reg(r, _) => {
                s.cfa = Cfa::Reg(r, d(factored_offset));
                Ok(())
            }
            Cfa::Expr(_) => Err(Bail),
        },
        I::DefCfaExpression { expression } => {
            s.cfa = Cfa::Expr(plt(expression));
            Ok(())
        }
        I::Undefined { register } => s.set(register, Rule::Undefined),
        I::SameValue { register } => s.set(register, Rule::Same),
        I::Offset {
            register,
            factored_offset,
        } => s.set(register, Rule::Offset(d(factored_offset as i64))),
        I::OffsetExtendedSf {
            register,
            factored_offset,
        } => s.set(register, Rule::Offset(d(factored_offset))),
        I::ValOffset { register, .. }
        | I::ValOffsetSf { register, .. }
        | I::Register {
            dest_register: register,
            ..
        }
        | I::Expression { register, .. }
        | I::ValExpression { register, .. } => s.set(register, Rule::Other),
        I::SetLoc { .. }
        | I::AdvanceLoc { .. }
        | I::Restore { .. }
        | I::RememberState
        | I::RestoreState
        | I::NegateRaState => return None,
    })
}

/// Evaluates a CIE's initial instructions. `None` leaves its FDEs to gimli: an address
/// size other than 8, or anything in the program but rule definitions.
pub(super) fn cie<R: Reader>(
    cie: &gimli::CommonInformationEntry<R>,
    mut program: CallFrameInstructionIter<'_, R>,
    plt: impl Fn(UnwindExpression<R::Offset>) -> Option<u16>,
) -> Option<Cie> {
    if cie.address_size() != 8 {
        return None;
    }
    let augmented = match cie.augmentation() {
        None => false,
        // 'z' with data; a bare "z" or "zS" is not told apart from GNU as's "S"
        // (no data) through gimli's accessors.
        Some(_) if cie.fde_address_encoding().is_some() || cie.lsda_encoding().is_some() => true,
        Some(_) if cie.personality().is_some() => true,
        Some(_) => return None,
    };
    let pointers = match cie.fde_address_encoding() {
        None => 8,
        Some(e) => {
            use gimli::constants as c;
            if !matches!(
                e.application(),
                c::DW_EH_PE_absptr
                    | c::DW_EH_PE_pcrel
                    | c::DW_EH_PE_textrel
                    | c::DW_EH_PE_datarel
                    | c::DW_EH_PE_funcrel
            ) {
                return None;
            }
            match e.format() {
                c::DW_EH_PE_absptr | c::DW_EH_PE_udata8 | c::DW_EH_PE_sdata8 => 8,
                c::DW_EH_PE_udata4 | c::DW_EH_PE_sdata4 => 4,
                c::DW_EH_PE_udata2 | c::DW_EH_PE_sdata2 => 2,
                _ => return None,
            }
        }
    };
    let daf = cie.data_alignment_factor();
    let mut s = State::EMPTY;
    while let Some(i) = program.next().ok()? {
        apply(&mut s, &i, daf, &plt)?.ok()?;
    }
    Some(Cie {
        init: s,
        base_rows: if s.regs.count_ones() >= 2 { 2 } else { 1 },
        caf: cie.code_alignment_factor(),
        daf,
        pointers,
        augmented,
    })
}

/// Evaluates an FDE's program from `start`, calling `row` with each row's address and
/// rules as gimli's `next_row` would return them (including repeats). On `Bail` some
/// rows may have been given already: the caller drops them.
pub(super) fn rows(
    cie: &Cie,
    mut program: Program<'_>,
    plt: impl Fn(UnwindExpression<usize>) -> Option<u16>,
    start: u64,
    mut row: impl FnMut(u64, &State),
) -> Result<(), Bail> {
    let mut s = cie.init;
    let mut saved = [State::EMPTY; STACK_ROWS - 1];
    let mut depth = 0;
    let mut pc = start;
    loop {
        let Some(i) = program.next()? else {
            row(pc, &s);
            return Ok(());
        };
        if let Some(done) = apply(&mut s, &i, cie.daf, &plt) {
            done?;
            continue;
        }
        match i {
            I::AdvanceLoc { delta } => {
                row(pc, &s);
                pc = pc
                    .checked_add(u64::from(delta).wrapping_mul(cie.caf))
                    .ok_or(Bail)?;
            }
            I::Restore { register } => {
                if register.0 >= TRACKED {
                    return Err(Bail);
                }
                if cie.init.regs & (1 << register.0) != 0 {
                    s.regs |= 1 << register.0;
                } else {
                    s.regs &= !(1 << register.0);
                }
                match register.0 {
                    RA => s.ra = cie.init.ra,
                    RBP => s.rbp = cie.init.rbp,
                    _ => {}
                }
            }
            I::RememberState => {
                if cie.base_rows + depth >= STACK_ROWS {
                    return Err(Bail);
                }
                saved[depth] = s;
                depth += 1;
            }
            I::RestoreState => {
                if depth == 0 {
                    return Err(Bail);
                }
                depth -= 1;
                s = saved[depth];
            }
            // set_loc is rare and has its own checks in gimli.
            _ => return Err(Bail),
        }
    }
}

#[cfg(test)]
#[path = "cfi_tests.rs"]
mod tests;
