//! Reading and emptying one BPF map set at the end of a round.
//!
//! The scheme (see `profile.bpf.c`): two map sets; the program writes the one named by
//! `active_set`. The round flips it, waits [`GRACE`] so that no program run still
//! writes the old set, then drains the old set here: counts by batched
//! lookup-and-delete, then each referenced stack by lookup, then delete. A sample lands
//! in exactly one set and is read exactly once.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

use firn_sampler_bpf::{COMM_LEN, MAX_STACK_DEPTH};
use libbpf_rs::libbpf_sys;

/// Far longer than any run of the program (interrupt context, microseconds).
pub const GRACE: Duration = Duration::from_millis(20);

/// Byte layout of `struct firn_sample_key`.
pub const KEY_SIZE: usize = 40;
const BATCH: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    #[error("draining the counts map: {0}")]
    Counts(std::io::Error),
    #[error("the BPF key is {got} bytes, the sampler expects {KEY_SIZE}")]
    KeySize { got: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StackRef {
    /// A stack id in the drained set's stack map.
    Id(u32),
    /// -errno from bpf_get_stackid.
    Err(i32),
}

#[derive(Debug, Clone)]
pub struct RawSample {
    pub tgid: u32,
    pub tid: u32,
    pub start_ns: u64,
    pub comm: [u8; COMM_LEN],
    pub user: StackRef,
    pub kernel: StackRef,
    pub count: u64,
}

#[derive(Debug, Default)]
pub struct Drained {
    pub samples: Vec<RawSample>,
    /// Frames of each stack id referenced by a sample (innermost first).
    pub stacks: HashMap<u32, Vec<u64>>,
    /// Stacks referenced but not found in the stack map.
    pub stack_lookup_failures: u64,
}

fn parse_key(k: &[u8]) -> Option<RawSample> {
    let u32_at = |o: usize| {
        k.get(o..o + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_ne_bytes)
    };
    let i32_at = |o: usize| {
        k.get(o..o + 4)
            .and_then(|b| b.try_into().ok())
            .map(i32::from_ne_bytes)
    };
    let stack = |v: i32| {
        if v >= 0 {
            StackRef::Id(v as u32)
        } else {
            StackRef::Err(v)
        }
    };
    Some(RawSample {
        tgid: u32_at(0)?,
        tid: u32_at(4)?,
        start_ns: u64::from_ne_bytes(k.get(8..16)?.try_into().ok()?),
        user: stack(i32_at(16)?),
        kernel: stack(i32_at(20)?),
        comm: k.get(24..24 + COMM_LEN)?.try_into().ok()?,
        count: 0,
    })
}

pub fn check_key_size(got: u32) -> Result<(), DrainError> {
    if got as usize == KEY_SIZE {
        Ok(())
    } else {
        Err(DrainError::KeySize { got })
    }
}

/// Empties `counts` (a hash of key → u64) and the stacks its keys refer to.
pub fn drain(counts: BorrowedFd<'_>, stacks: BorrowedFd<'_>) -> Result<Drained, DrainError> {
    let mut out = Drained::default();
    let mut keys = vec![0u8; BATCH * KEY_SIZE];
    let mut values = vec![0u64; BATCH];
    let mut token = [0u8; KEY_SIZE];
    let mut first = true;
    loop {
        let mut n = BATCH as u32;
        let opts = batch_opts();
        let in_batch = if first {
            std::ptr::null_mut()
        } else {
            token.as_mut_ptr().cast()
        };
        let mut out_token = [0u8; KEY_SIZE];
        // SAFETY: the buffers hold BATCH keys / values of the map's sizes, the token
        // buffers one key each; libbpf writes at most `n` entries.
        let ret = unsafe {
            libbpf_sys::bpf_map_lookup_and_delete_batch(
                counts.as_raw_fd(),
                in_batch,
                out_token.as_mut_ptr().cast(),
                keys.as_mut_ptr().cast(),
                values.as_mut_ptr().cast(),
                &mut n,
                &opts,
            )
        };
        let done = if ret < 0 {
            let err = std::io::Error::from_raw_os_error(-ret);
            match -ret {
                libc::ENOENT => true,
                libc::EINTR => continue,
                _ => return Err(DrainError::Counts(err)),
            }
        } else {
            false
        };
        for i in 0..(n as usize).min(BATCH) {
            if let Some(mut s) = parse_key(&keys[i * KEY_SIZE..(i + 1) * KEY_SIZE]) {
                s.count = values[i];
                out.samples.push(s);
            }
        }
        if done {
            break;
        }
        token = out_token;
        first = false;
    }
    let mut frames = vec![0u64; MAX_STACK_DEPTH];
    for s in &out.samples {
        for r in [s.user, s.kernel] {
            let StackRef::Id(id) = r else { continue };
            if out.stacks.contains_key(&id) {
                continue;
            }
            // SAFETY: key is a u32, value buffer holds MAX_STACK_DEPTH u64s (value_size).
            let ret = unsafe {
                libbpf_sys::bpf_map_lookup_elem(
                    stacks.as_raw_fd(),
                    (&id as *const u32).cast(),
                    frames.as_mut_ptr().cast(),
                )
            };
            if ret < 0 {
                out.stack_lookup_failures += 1;
                continue;
            }
            let depth = frames.iter().position(|&f| f == 0).unwrap_or(frames.len());
            out.stacks.insert(id, frames[..depth].to_vec());
            frames.iter_mut().for_each(|f| *f = 0);
        }
    }
    for id in out.stacks.keys() {
        // SAFETY: key is a u32. A failed delete leaves a stale entry that a later
        // identical stack reuses; nothing is miscounted.
        unsafe {
            libbpf_sys::bpf_map_delete_elem(stacks.as_raw_fd(), (id as *const u32).cast());
        }
    }
    Ok(out)
}

fn batch_opts() -> libbpf_sys::bpf_map_batch_opts {
    libbpf_sys::bpf_map_batch_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_map_batch_opts>() as _,
        ..Default::default()
    }
}

/// Sums a per-CPU u64 array slot over all CPUs.
pub fn percpu_sum(map: &dyn libbpf_rs::MapCore, slot: u32) -> Option<u64> {
    let vals = map
        .lookup_percpu(&slot.to_ne_bytes(), libbpf_rs::MapFlags::ANY)
        .ok()??;
    Some(
        vals.iter()
            .filter_map(|v| {
                v.get(..8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_ne_bytes)
            })
            .sum(),
    )
}

/// Borrowed fd of a map, for the raw calls above.
pub fn fd_of(map: &dyn libbpf_rs::MapCore) -> BorrowedFd<'_> {
    map.as_fd()
}
