//! Reading and emptying one BPF map set at the end of a round.
//!
//! The scheme (see `profile.bpf.c`): two map sets; the program writes the one named by
//! `active_set`. The round flips it, waits [`GRACE`] so that no program run still
//! writes the old set, then drains the old set here: the sample log's half of the set
//! through a mapping (`sample_log.rs`), counts by batched lookup-and-delete, then each
//! referenced stack by lookup, then delete. A sample lands
//! in exactly one set and is read exactly once. User stacks, unwound by the program
//! itself, are in the set's ustacks map under a hash of their frames.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

use firn_sampler_bpf::{COMM_LEN, MAX_STACK_DEPTH};
use libbpf_rs::libbpf_sys;

/// Far longer than any run of the program (interrupt context, microseconds).
pub(crate) const GRACE: Duration = Duration::from_millis(20);

/// `struct firn_sample_key` of `profile.bpf.h`, as the skeleton generates it.
type Key = firn_sampler_bpf::types::firn_sample_key;
/// Bytes of a counts map key.
pub(crate) const KEY_SIZE: usize = std::mem::size_of::<Key>();
// The comm is the key's last field and COMM_LEN bytes long.
const _: () = assert!(std::mem::offset_of!(Key, comm) + COMM_LEN == KEY_SIZE);
const BATCH: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub(crate) enum DrainError {
    #[error("draining the counts map: {0}")]
    Counts(std::io::Error),
    #[error("the BPF key is {got} bytes, the sampler expects {KEY_SIZE}")]
    KeySize { got: u32 },
    #[error("the BPF stack map holds {got}-byte stacks, the sampler expects {}", MAX_STACK_DEPTH * 8)]
    StackSize { got: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StackRef {
    /// Key in the drained set's kstacks map.
    Id(u64),
    /// -errno: EFAULT no kernel stack, ENOMEM the map was full.
    Err(i32),
}

impl StackRef {
    /// Its key in the kstacks map, if it has one.
    pub(crate) fn key(self) -> Option<u64> {
        match self {
            Self::Id(h) => Some(h),
            Self::Err(_) => None,
        }
    }
}

/// A user stack as the key names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UserRef {
    /// Key in the drained set's ustacks map.
    Hash(u64),
    /// -errno: EFAULT no user stack, ENOMEM the map was full.
    Err(i32),
}

impl UserRef {
    /// Its key in the ustacks map, if it has one.
    pub(crate) fn key(self) -> Option<u64> {
        match self {
            Self::Hash(h) => Some(h),
            Self::Err(_) => None,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct RawSample {
    pub(crate) tgid: u32,
    pub(crate) tid: u32,
    pub(crate) start_ns: u64,
    /// The process's exec count: samples before and after an exec differ here.
    pub(crate) exec_id: u32,
    pub(crate) comm: [u8; COMM_LEN],
    pub(crate) user: UserRef,
    pub(crate) kernel: StackRef,
    /// Why the unwinder stopped (`enum firn_unwind_end`).
    pub(crate) unwind_end: u32,
    /// The cgroup v2 id the sample was taken in.
    pub(crate) cgroup_id: u64,
    /// `count` is off-CPU nanoseconds (`FIRN_KIND_OFF_CPU`), not samples.
    pub(crate) off_cpu: bool,
    pub(crate) count: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Drained {
    pub(crate) samples: Vec<RawSample>,
    /// Frames of each kernel stack referenced by a sample (innermost first).
    pub(crate) stacks: HashMap<u64, Vec<u64>>,
    /// Frames of each user stack referenced by a sample (innermost first).
    pub(crate) user_stacks: HashMap<u64, Vec<u64>>,
    /// Stacks referenced but not found in the stack map.
    pub(crate) stack_lookup_failures: u64,
    /// Python code objects' names copied since the last drain (Batch.pythonCode).
    pub(crate) python_code: Vec<Vec<u8>>,
    /// Entries of the code map that could not be read out.
    pub(crate) python_code_failures: u64,
    /// 1 when the sample log's mapping failed (then its samples wait for the set's next
    /// drain) or its unmapping did (then they were taken).
    pub(crate) sample_log_failures: u64,
}

fn parse_key(k: &[u8]) -> Option<RawSample> {
    if k.len() < KEY_SIZE {
        return None;
    }
    // SAFETY: `k` holds at least size_of::<Key>() bytes, read unaligned; Key is plain
    // integers and bytes (generated from the program's BTF), valid for any bit pattern.
    let key: Key = unsafe { std::ptr::read_unaligned(k.as_ptr().cast()) };
    Some(RawSample {
        tgid: key.tgid,
        tid: key.tid,
        start_ns: key.start_ns,
        exec_id: key.exec_id,
        user: if key.user_status == 0 && key.user_stack != 0 {
            UserRef::Hash(key.user_stack)
        } else {
            UserRef::Err(i32::from(key.user_status).min(-1))
        },
        kernel: if key.kern_status == 0 && key.kern_stack != 0 {
            StackRef::Id(key.kern_stack)
        } else {
            StackRef::Err(i32::from(key.kern_status).min(-1))
        },
        unwind_end: u32::from(key.unwind_end),
        cgroup_id: key.cgroup_id,
        comm: key.comm.map(|c| c as u8),
        off_cpu: key.kind == firn_sampler_bpf::types::firn_sample_kind::FIRN_KIND_OFF_CPU.0 as u8,
        count: 0,
    })
}

/// Checks the loaded maps against the layout this build reads: the counts map's key
/// size and the stack map's value size.
pub(crate) fn check_layout(key_size: u32, stack_value_size: u32) -> Result<(), DrainError> {
    check_key_size(key_size)?;
    if stack_value_size as usize != MAX_STACK_DEPTH * 8 {
        return Err(DrainError::StackSize {
            got: stack_value_size,
        });
    }
    Ok(())
}

pub(crate) fn check_key_size(got: u32) -> Result<(), DrainError> {
    if got as usize == KEY_SIZE {
        Ok(())
    } else {
        Err(DrainError::KeySize { got })
    }
}

/// Empties set `set`'s half of the sample log (if there is one), both counts maps
/// (samples, off-CPU waits: hashes of key → u64) and the stacks their keys refer to.
pub(crate) fn drain(
    (log, set): (Option<&crate::sample_log::SampleLog>, u32),
    counts: [BorrowedFd<'_>; 2],
    kstacks: BorrowedFd<'_>,
    ustacks: BorrowedFd<'_>,
) -> Result<Drained, DrainError> {
    let mut out = Drained::default();
    if let Some(log) = log {
        let taken = log.take(set, |k, n| push_counted(&mut out.samples, k, n));
        if let Err(error) = taken {
            tracing::warn!(%error, set, "draining the sample log failed");
            out.sample_log_failures += 1;
        }
    }
    for c in counts {
        drain_counts(c, &mut out)?;
    }
    let mut frames = vec![0u64; MAX_STACK_DEPTH];
    let user: Vec<u64> = out.samples.iter().filter_map(|s| s.user.key()).collect();
    let kernel: Vec<u64> = out.samples.iter().filter_map(|s| s.kernel.key()).collect();
    out.stack_lookup_failures += take_stacks(ustacks, &user, &mut out.user_stacks, &mut frames);
    out.stack_lookup_failures += take_stacks(kstacks, &kernel, &mut out.stacks, &mut frames);
    Ok(out)
}

/// Takes every entry out of a hash map in batches of `batch`, handing each (key, value)
/// to `f`, at most `max` entries (the rest stay for the next call). Returns the
/// entries taken, or the error of the batch that failed (the caller counts it).
pub(crate) fn take_all(
    map: BorrowedFd<'_>,
    (key_size, value_size): (usize, usize),
    (batch, max): (usize, usize),
    mut f: impl FnMut(&[u8], &[u8]),
) -> Result<usize, std::io::Error> {
    let mut keys = vec![0u8; batch * key_size];
    let mut values = vec![0u8; batch * value_size];
    let mut token = vec![0u8; key_size];
    let mut out_token = vec![0u8; key_size];
    let (mut taken, mut first) = (0, true);
    while taken < max {
        // Never more than the bound: the kernel returns up to `n`, and the walk adds
        // entries while the drain runs.
        let mut n = batch.min(max - taken) as u32;
        let opts = batch_opts();
        let in_batch = if first {
            std::ptr::null_mut()
        } else {
            token.as_mut_ptr().cast()
        };
        // SAFETY: the buffers hold `batch` keys and values of the map's sizes, the
        // tokens one key each; the kernel writes at most `n` entries.
        let ret = unsafe {
            libbpf_sys::bpf_map_lookup_and_delete_batch(
                map.as_raw_fd(),
                in_batch,
                out_token.as_mut_ptr().cast(),
                keys.as_mut_ptr().cast(),
                values.as_mut_ptr().cast(),
                &mut n,
                &opts,
            )
        };
        let done = match -ret {
            0 => false,
            libc::ENOENT => true,
            libc::EINTR => continue,
            e => return Err(std::io::Error::from_raw_os_error(e)),
        };
        for i in 0..(n as usize).min(batch) {
            f(
                &keys[i * key_size..(i + 1) * key_size],
                &values[i * value_size..(i + 1) * value_size],
            );
        }
        taken += n as usize;
        if done {
            break;
        }
        token.copy_from_slice(&out_token);
        first = false;
    }
    Ok(taken)
}

/// Every entry of the Python walk's code map, taken out, cut to the lengths the walk
/// wrote (each clamped to its array: the bytes themselves are the process's and are
/// never looked at). Called after the set's grace period: a sample's code objects were
/// copied before it was counted, so they are all in by then.
pub(crate) fn take_python_code(pycode: BorrowedFd<'_>, out: &mut Drained) {
    use firn_sampler_bpf::types::firn_py_code;
    use firn_schema::python_code::{frame, CodeBlob};
    let size = std::mem::size_of::<firn_py_code>();
    let max = firn_schema::limits::MAX_PYTHON_CODES as usize;
    let taken = take_all(pycode, (8, size), (32, max), |_, v| {
        // SAFETY: `v` holds size_of::<firn_py_code>() bytes, read unaligned; the type is
        // plain integers and byte arrays, valid for any bit pattern.
        let v: firn_py_code = unsafe { std::ptr::read_unaligned(v.as_ptr().cast()) };
        let cut = |b: &[u8], n: u16| b[..usize::from(n).min(b.len())].to_vec();
        // The walk's arrays are C chars: bytes, whatever their sign.
        let name: Vec<u8> = v.name.iter().map(|&c| c as u8).collect();
        let file: Vec<u8> = v.file.iter().map(|&c| c as u8).collect();
        let (name, file, table) = (
            cut(&name, v.name_len),
            cut(&file, v.file_len),
            cut(&v.table, v.table_len),
        );
        let blob = CodeBlob {
            id: v.id & frame::ID_MASK,
            first_line: v.first_line,
            minor: v.minor,
            flags: v.flags,
            name: &name,
            file: &file,
            table: &table,
        };
        out.python_code.push(blob.to_bytes());
    });
    if taken.is_err() {
        out.python_code_failures += 1;
    }
}

/// A key (from the log or a counts map) and its count, as a sample.
fn push_counted(samples: &mut Vec<RawSample>, k: &[u8], count: u64) {
    if let Some(mut s) = parse_key(k) {
        s.count = count;
        samples.push(s);
    }
}

/// Every sample key and count, taken out of the counts map in batches.
fn drain_counts(counts: BorrowedFd<'_>, out: &mut Drained) -> Result<(), DrainError> {
    take_all(counts, (KEY_SIZE, 8), (BATCH, usize::MAX), |k, v| {
        let mut c = [0u8; 8];
        c.copy_from_slice(v);
        push_counted(&mut out.samples, k, u64::from_ne_bytes(c));
    })
    .map(|_| ())
    .map_err(DrainError::Counts)
}

/// The stacks of `keys`, each taken out of its map (hash key → frames) once, into
/// `into`. Returns the keys not found.
fn take_stacks(
    map: BorrowedFd<'_>,
    keys: &[u64],
    into: &mut HashMap<u64, Vec<u64>>,
    frames: &mut [u64],
) -> u64 {
    let mut missing = 0;
    for &hash in keys {
        if into.contains_key(&hash) {
            continue;
        }
        // SAFETY: key is a u64, value buffer holds MAX_STACK_DEPTH u64s (value_size).
        let ret = unsafe {
            libbpf_sys::bpf_map_lookup_and_delete_elem(
                map.as_raw_fd(),
                (&hash as *const u64).cast(),
                frames.as_mut_ptr().cast(),
            )
        };
        if ret < 0 {
            missing += 1;
            continue;
        }
        let depth = frames.iter().position(|&f| f == 0).unwrap_or(frames.len());
        into.insert(hash, frames[..depth].to_vec());
        frames.iter_mut().for_each(|f| *f = 0);
    }
    missing
}

fn batch_opts() -> libbpf_sys::bpf_map_batch_opts {
    libbpf_sys::bpf_map_batch_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_map_batch_opts>() as _,
        ..Default::default()
    }
}

/// Every slot of a per-CPU u64 array of `slots` entries, each summed over all CPUs, in
/// one batch lookup: one system call a round for all the program's counters instead of
/// one a counter. (libbpf-rs's `lookup_batch` sizes values for one CPU, so not for
/// per-CPU maps.)
pub(crate) fn percpu_sums(map: BorrowedFd<'_>, slots: u32) -> Result<Vec<u64>, std::io::Error> {
    let cpus = libbpf_rs::num_possible_cpus().map_err(|e| std::io::Error::other(e.to_string()))?;
    let n_slots = slots as usize;
    let mut keys = vec![0u32; n_slots];
    let mut values = vec![0u64; n_slots * cpus];
    let mut out_token = 0u32;
    let mut n = slots;
    let opts = batch_opts();
    // SAFETY: `keys` holds `slots` u32 keys and `values` `slots` per-CPU values (8
    // bytes a possible CPU, as the kernel copies them); the kernel writes at most `n`
    // entries, and the token is one key.
    let ret = unsafe {
        libbpf_sys::bpf_map_lookup_batch(
            map.as_raw_fd(),
            std::ptr::null_mut(),
            (&raw mut out_token).cast(),
            keys.as_mut_ptr().cast(),
            values.as_mut_ptr().cast(),
            &mut n,
            &opts,
        )
    };
    // ENOENT: the array's end was reached within the batch; every slot was read if
    // the count says so.
    if ret < 0 && -ret != libc::ENOENT {
        return Err(std::io::Error::from_raw_os_error(-ret));
    }
    if n != slots {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("{n} of {slots} counters read"),
        ));
    }
    let mut sums = vec![0u64; n_slots];
    for (i, &k) in keys.iter().enumerate() {
        if let Some(sum) = sums.get_mut(k as usize) {
            *sum = values[i * cpus..(i + 1) * cpus]
                .iter()
                .fold(0u64, |a, &v| a.wrapping_add(v));
        }
    }
    Ok(sums)
}

/// Sums a per-CPU u64 array slot over all CPUs.
pub(crate) fn percpu_sum(map: &dyn libbpf_rs::MapCore, slot: u32) -> Option<u64> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_with_the_generated_layout() {
        let mut comm = [0i8; COMM_LEN];
        for (c, b) in comm.iter_mut().zip(b"worker") {
            *c = *b as i8;
        }
        let key = Key {
            tgid: 41,
            tid: 42,
            start_ns: 7_000_000_001,
            user_stack: 0xfeed,
            user_status: 0,
            kern_stack: 0,
            kern_status: -(libc::EFAULT as i8),
            exec_id: 5,
            unwind_end: 3,
            kind: 1,
            cgroup_id: 77,
            comm,
        };
        let mut bytes = [0u8; KEY_SIZE];
        // SAFETY: `bytes` is exactly one Key long; copying a POD value into it.
        unsafe { std::ptr::write_unaligned(bytes.as_mut_ptr().cast(), key) };
        let s = parse_key(&bytes).expect("a whole key");
        assert_eq!(
            (s.tgid, s.tid, s.start_ns, s.exec_id),
            (41, 42, 7_000_000_001, 5)
        );
        assert_eq!(s.user, UserRef::Hash(0xfeed));
        assert_eq!((s.unwind_end, s.cgroup_id, s.off_cpu), (3, 77, true));
        assert_eq!(s.kernel, StackRef::Err(-libc::EFAULT));
        assert_eq!(&s.comm[..6], b"worker");
        assert!(parse_key(&bytes[..KEY_SIZE - 1]).is_none());
        assert_eq!(KEY_SIZE, 64);
        // A kernel stack by its hash; a stored one whose status says otherwise is not.
        let mut k2 = key;
        k2.kern_stack = 0xbeef;
        k2.kern_status = 0;
        // SAFETY: as above.
        unsafe { std::ptr::write_unaligned(bytes.as_mut_ptr().cast(), k2) };
        let s = parse_key(&bytes).expect("a whole key");
        assert_eq!(s.kernel, StackRef::Id(0xbeef));
    }
}
