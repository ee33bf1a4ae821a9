// SPDX-License-Identifier: GPL-2.0
/*
 * firn's sampling program. Attached to a cpu-clock perf event on every CPU.
 * Per sample it counts (tgid, tid, start, comm, user stack, kernel stack).
 *
 * Draining without double counting: there are two identical map sets (kstacks_N,
 * ustacks_N and counts_N). `active_set` (in .bss, mmapped by the sampler) says which set the program
 * writes. At a round's end the sampler flips it, waits a grace period far longer than
 * any program run (the program runs in interrupt context, microseconds), then reads
 * and empties the inactive set at leisure. A sample lands in exactly one set, and a
 * stack's key always refers to the stack map of its own set.
 *
 * A sample's key goes to the `samples` log, not to a hash map: the slot at this CPU's
 * place in its own run of the set's half, a line of memory and no search (a counts map
 * lookup cold at 99 Hz took a fifth of a sample). The sampler adds the keys up when it
 * drains the set and frees their slots. A run that comes round to a slot not yet freed
 * is full for this round: its samples go to counts_N, which is drained as before, so a
 * full log loses nothing.
 *
 * Process discovery: the first sample of a process (tgid, start time, exec count) puts
 * one NEW event in the `events` ring buffer, so the sampler reads its /proc entry
 * within milliseconds instead of at the round's end, when a short-lived process is
 * long gone. The `seen` LRU map keeps it to one event per process; a process is marked
 * seen only once its event is written, so a full ring buffer is retried by the next
 * sample. Exec and exit of a seen process send EXEC and EXIT events. A sample is never
 * held back for discovery: it is counted whether or not the process is known.
 *
 * User stacks are unwound here (unwind.bpf.h), not by bpf_get_stackid, so that code
 * built without frame pointers gets whole stacks. The stack is stored by a seeded hash
 * of its frames and process in ustacks_N (one per map set). Kernel stacks are taken by
 * bpf_get_stack and stored the same way in kstacks_N: a map that holds only this
 * round's distinct stacks (not a preallocated stack-trace map sized for the worst
 * round), where two stacks never compete for one bucket.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "profile.bpf.h"

char LICENSE[] SEC("license") = "GPL";

#define STACK_ENTRIES 16384
#define COUNT_ENTRIES 16384

struct count_map {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, COUNT_ENTRIES);
	__type(key, struct firn_sample_key);
	__type(value, __u64);
};

/* User (and kernel) stacks by hash of their frames. Not preallocated: a set holds only
 * this round's distinct stacks, and the sampler empties it each round. */
struct ustack_map {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, STACK_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, struct firn_user_stack);
};

struct ustack_map kstacks_0 SEC(".maps");
struct ustack_map kstacks_1 SEC(".maps");
struct ustack_map ustacks_0 SEC(".maps");
struct ustack_map ustacks_1 SEC(".maps");
struct count_map counts_0 SEC(".maps");
struct count_map counts_1 SEC(".maps");
/* Off-CPU waits by key (--off-cpu; one entry each without it): apart from the samples,
 * so that a storm of distinct waits cannot crowd samples out of their map. */
struct count_map offcounts_0 SEC(".maps");
struct count_map offcounts_1 SEC(".maps");

/* The sample log, both sets: set s and CPU c own the run of log_slots slots from
 * (s * log_cpus + c) * log_slots (the sampler sets max_entries and the two below before
 * load). Mmapable: the sampler reads a drained set's half through a mapping of its own. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, union firn_log_slot);
} samples SEC(".maps");
/* Slots of a run (0: no log, every sample goes to counts_N) and CPUs with a run (ids up
 * to the highest online at load; a CPU above them counts in counts_N). */
const volatile __u32 log_slots = 0;
const volatile __u32 log_cpus = 0;

/* Processes already announced to the sampler, with the cgroup id they were last
 * sampled in. The sampler deletes an entry when it forgets the process, and LRU
 * eviction only costs a later read at the round's end. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 32768);
	__type(key, struct firn_proc_id);
	__type(value, struct firn_seen);
} seen SEC(".maps");

/* The program's globals, in .bss: an mmapable array whose value is page-aligned, so
 * the six below share one cache line (every sample reads them, each cold again at
 * 99 Hz). Declared together and in this order so that they are laid out so; the sampler
 * asserts it (attach.rs). */

/* Moved by every CPU that tells the sampler of a process's new cgroup: another CPU's
 * memo of that process then no longer holds (it may have moved back meanwhile). */
volatile __u32 cgroup_epoch = 0;
/* Moved by the sampler (a store through its own mapping of .bss) after it deletes from
 * `seen` or changes `pyprocs`, `procmaps` or `tables`: a CPU's memos of the process it
 * sampled last (key_of) and of the mappings and rows it resolved (mappings.bpf.h) hold
 * only under the value they were made in. */
volatile __u32 proc_epoch = 0;
/* Written by the sampler through the mmapped .bss; read once per sample. */
volatile __u32 active_set = 0;
/* Counts the flips (the sampler adds one with each): a wait off CPU tells by it whether
 * the set its stacks went to is still the one it began in, not drained since. */
volatile __u32 set_epoch = 0;
/* Moved by every exec, thread exit and cgroup move (the hooks below): a CPU's memo of
 * the thread it sampled last (key_of) holds only under the value it was made in. */
volatile __u32 task_epoch = 0;
/* Written by the sampler before load (random), never by a program: user and kernel
 * stacks are keyed by a hash no local user can predict, so none can craft frames that
 * take another stack's key. Only the holder of the map's fd (the sampler) can read it. */
volatile __u64 hash_seed = 0;

/* A process asks for its mappings to be read again at most this often. A JIT whose
 * code regions come and go asks too; the sampler backs off from a process whose reads
 * find only new anonymous code. */
#define FIRN_REMAP_EVERY_NS 100000000ULL

/* Process events. The sampler sets its size (--events-buffer-kib) before loading. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FIRN_CTR_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

/* Only to make the key and counter types visible in the skeleton's BTF, so that the
 * sampler's Rust types are generated from this header. */
struct firn_sample_key unused_key = {};
enum firn_counter unused_counter = FIRN_CTR_SAMPLES;
struct firn_event unused_event = {};
struct firn_proc_id unused_proc_id = {};
struct firn_seen unused_seen = {};
enum firn_event_kind unused_event_kind = FIRN_EV_NEW;
enum firn_sample_kind unused_sample_kind = FIRN_KIND_CPU;
enum firn_unwind_end unused_unwind_end = FIRN_END_COMPLETE;
enum firn_cfa_kind unused_cfa_kind = FIRN_CFA_NONE;
enum firn_rbp_kind unused_rbp_kind = FIRN_RBP_SAME;
struct firn_unwind_row unused_row = {};
struct firn_table unused_table = {};
struct firn_proc_maps unused_proc_maps = {};
struct firn_py_proc unused_py_proc = {};
struct firn_py_code unused_py_code = {};
union firn_log_slot unused_log_slot = {};

static __always_inline void bump(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&counters, &idx);
	if (v)
		*v += 1;
}

static __always_inline void add(__u32 idx, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(&counters, &idx);
	if (v)
		*v += n;
}

/* The process `task` belongs to, as the sample keys name it. */
static __always_inline void proc_id_of(struct task_struct *task, struct firn_proc_id *id)
{
	struct task_struct *leader = BPF_CORE_READ(task, group_leader);

	id->tgid = BPF_CORE_READ(task, tgid);
	id->start_ns = BPF_CORE_READ(leader, start_boottime);
	/* Counts one up per exec (begin_new_exec), copied to threads at clone. */
	id->exec_id = (__u32)BPF_CORE_READ(leader, self_exec_id);
}

/* 0 once the event is in the ring buffer; -1 (counted) when the buffer is full. */
static __always_inline int emit(__u32 kind, const struct firn_proc_id *id, __u64 cgroup_id)
{
	struct firn_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);

	if (!e) {
		bump(FIRN_CTR_EVENTS_LOST);
		return -1;
	}
	e->kind = kind;
	e->tgid = id->tgid;
	e->start_ns = id->start_ns;
	e->exec_id = id->exec_id;
	bpf_get_current_comm(&e->comm, sizeof(e->comm));
	e->exe_dev = 0;
	e->exe_ino = 0;
	e->start_code = 0;
	e->ppid = 0;
	e->euid = 0;
	e->flags = 0;
	e->reserved = 0;
	__builtin_memset(e->leader_comm, 0, sizeof(e->leader_comm));
	if (kind == FIRN_EV_NEW) {
		struct task_struct *task = (struct task_struct *)bpf_get_current_task();

		e->ppid = BPF_CORE_READ(task, real_parent, tgid);
		/* The objective credentials, as /proc's owner: `cred` is the subjective
		 * set, which override_creds swaps (overlayfs copy-up, nfsd). */
		e->euid = BPF_CORE_READ(task, real_cred, euid.val);
		if (BPF_CORE_READ(task, flags) & FIRN_PF_KTHREAD)
			e->flags |= FIRN_EVF_KTHREAD;
		BPF_CORE_READ_STR_INTO(&e->leader_comm, task, group_leader, comm);
		/* Lets the sampler tell whether /proc still shows this program when it reads
		 * it (an exec may come between), and describe a process gone before it could
		 * be read from another of the same file (its code placed by start_code).
		 * All 0 for a kernel thread. */
		e->exe_ino = BPF_CORE_READ(task, mm, exe_file, f_inode, i_ino);
		e->exe_dev = BPF_CORE_READ(task, mm, exe_file, f_inode, i_sb, s_dev);
		e->start_code = BPF_CORE_READ(task, mm, start_code);
	}
	e->cgroup_id = cgroup_id;
	/* Only a new process and stale mappings are urgent (the process may be gone in
	 * milliseconds, its samples meanwhile leaf only); exec and exit events wait for
	 * the next wakeup or the round's end, which halves the wakeups. An urgent one
	 * forces its wakeup: the default wakes only a consumer that has read everything
	 * before it, and a waiting exit event would then hold it back. */
	bpf_ringbuf_submit(e, kind == FIRN_EV_NEW || kind == FIRN_EV_REMAP ? BPF_RB_FORCE_WAKEUP
									   : BPF_RB_NO_WAKEUP);
	bump(FIRN_CTR_EVENTS);
	return 0;
}

/* A seen process that ends (exec or exit): tell the sampler, forget it here. */
static __always_inline void ended(__u32 kind, const struct firn_proc_id *id)
{
	if (!bpf_map_lookup_elem(&seen, id))
		return;
	bpf_map_delete_elem(&seen, id);
	emit(kind, id, 0);
}

/* The sample of `key` ran code outside the mappings of its process's record: the
 * sampler reads them again now, not at the round's end, so that its stacks are whole
 * from the next sample (a process read while its loader was still mapping libraries;
 * a dlopen). At most once per FIRN_REMAP_EVERY_NS per process. */
static __always_inline void remap(const struct firn_sample_key *key)
{
	struct firn_proc_id pid = {
		.tgid = key->tgid,
		.exec_id = key->exec_id,
		.start_ns = key->start_ns,
	};
	struct firn_seen *s = bpf_map_lookup_elem(&seen, &pid);
	__u64 now;

	if (!s)
		return;
	now = bpf_ktime_get_ns();
	if (now - s->remap_ns >= FIRN_REMAP_EVERY_NS && emit(FIRN_EV_REMAP, &pid, key->cgroup_id) == 0)
		s->remap_ns = now;
}

/* The context allows only whole 8-byte loads of the saved registers. */
static __always_inline int user_mode(struct bpf_perf_event_data *ctx)
{
	__u64 cs = *(volatile __u64 *)((char *)ctx + __builtin_offsetof(struct pt_regs, cs));
	return (cs & 3) != 0;
}


#include "unwind.bpf.h"

/* The kernel stack of this sample (`skip` frames left out) into set `set`'s `kstacks`,
 * keyed by a seeded hash of its frames; the key's kern_stack and kern_status say where or
 * why not. Taken into the walk's scratch (the user stack there is stored already). */
static __always_inline void kernel_stack(void *ctx, __u32 set, __u64 skip,
					 struct firn_sample_key *key)
{
	struct firn_unwind_state *st;
	__u32 cpu, i, len;
	void *kstacks;
	long n;
	__u64 h;

	st = walk_state(&cpu);
	if (!st) {
		key->kern_status = -FIRN_EFAULT;
		return;
	}
	n = bpf_get_stack(ctx, st->stack.frames, sizeof(st->stack.frames), skip);
	if (n <= 0) {
		/* -EFAULT (or nothing): no kernel stack here. Normal, not a loss. */
		if (n < 0 && n != -FIRN_EFAULT)
			bump(FIRN_CTR_KERN_STACK_ERR);
		key->kern_status = -FIRN_EFAULT;
		return;
	}
	len = (__u32)n / sizeof(__u64);
	if (len > FIRN_MAX_STACK_DEPTH)
		len = FIRN_MAX_STACK_DEPTH;
	if (len < FIRN_MAX_STACK_DEPTH)
		st->stack.frames[len] = 0;
	h = mix(hash_seed ^ 0x84222325cbf29ce4ULL, len);
#pragma clang loop unroll(disable)
	for (i = 0; i < FIRN_MAX_STACK_DEPTH; i++) {
		if (i >= len)
			break;
		h = mix(h, st->stack.frames[i]);
	}
	key->kern_stack = h ? h : 1;
	/* Chosen after the loop: a map pointer live across it splits the verifier's states
	 * by set. */
	kstacks = set == 0 ? (void *)&kstacks_0 : (void *)&kstacks_1;
	if (bpf_map_lookup_elem(kstacks, &key->kern_stack))
		return;
	/* Another CPU may have stored the same stack meanwhile (EEXIST): fine. */
	if (bpf_map_update_elem(kstacks, &key->kern_stack, &st->stack, BPF_NOEXIST) != 0 &&
	    !bpf_map_lookup_elem(kstacks, &key->kern_stack)) {
		bump(FIRN_CTR_KERN_STACK_FULL);
		key->kern_stack = 0;
		key->kern_status = -FIRN_ENOMEM;
	}
}

/* Adds `amount` to `key`'s entry of `counts`. */
static __always_inline void count_key(void *counts, struct firn_sample_key *key, __u64 amount)
{
	__u64 *count = bpf_map_lookup_elem(counts, key);

	if (count) {
		__sync_fetch_and_add(count, amount);
		return;
	}
	if (bpf_map_update_elem(counts, key, &amount, BPF_NOEXIST) != 0) {
		/* Another CPU may have inserted the same key meanwhile. */
		count = bpf_map_lookup_elem(counts, key);
		if (count)
			__sync_fetch_and_add(count, amount);
		else
			bump(FIRN_CTR_COUNTS_FULL);
	}
}

/* The counts map of set `set`. */
static __always_inline void *counts_of(__u32 set)
{
	return set == 0 ? (void *)&counts_0 : (void *)&counts_1;
}

/* Puts `key` in this CPU's run of set `set`'s log, at the slot after the one it wrote
 * last: 0, or -1 when the slot is not free (the run is full this round) or there is no
 * run for this CPU. */
static __always_inline int log_key(__u32 set, const struct firn_sample_key *key)
{
	struct firn_unwind_state *st;
	union firn_log_slot *slot;
	__u32 cpu, at, next;

	st = walk_state(&cpu);
	if (!st || cpu >= log_cpus || log_slots == 0)
		return -1;
	set &= 1;
	/* Where the last run of this set stopped: the sampler frees every slot of a drained
	 * set, so the run goes on from there, round and round. */
	next = st->log_next[set];
	if (next >= log_slots)
		next = 0;
	at = (set * log_cpus + cpu) * log_slots + next;
	slot = bpf_map_lookup_elem(&samples, &at);
	if (!slot)
		return -1;
	if (slot->key.tgid != 0) {
		bump(FIRN_CTR_LOG_FULL);
		return -1;
	}
	slot->key = *key;
	st->log_next[set] = next + 1;
	return 0;
}

/* The key of the current task (`task`, from bpf_get_current_task_btf) with its stacks
 * stored in set `set`; announces a process seen for the first time. */
static __always_inline void key_of(void *ctx, struct task_struct *task, int in_user, __u32 set,
				   __u16 kind, struct firn_sample_key *key)
{
	/* Ids and comm are plain loads of `task` (the JIT guards them), not four helper
	 * calls: that made a sample ~14 % cheaper at 99 Hz (BENCHMARKS, thirtieth part),
	 * likely the helpers' cold code (strscpy_pad's) and their return thunks; this VM
	 * has no counters to tell. The address kept in the walk state for the thread memo
	 * is allowed because the loader has CAP_PERFMON. */
	__u64 cur_task = (__u64)task;
	struct task_struct *leader;
	struct firn_unwind_state *st;
	struct firn_proc_id pid;
	struct firn_seen *was, fresh = {};
	__u32 cpu, tepoch;

	key->tgid = task->tgid;
	key->tid = task->pid;
	key->kind = kind;
	/* Two whole words: the kernel keeps comm NUL-ended and zero-padded. The helper's
	 * copy always had both; this one, racing a rename or an exec, may keep the old
	 * name's bytes after the NUL or hold 16 bytes without one (the helper gave 15). The
	 * sampler cuts at the first NUL or at 16 bytes; a torn read mixes two names, as the
	 * helper's could. */
	__builtin_memcpy(&key->comm, task->comm, sizeof(key->comm));

	st = walk_state(&cpu);
	if (!st) {
		/* Never: the array has an entry for every possible CPU. */
		key->user_status = -FIRN_EFAULT;
		key->kern_status = -FIRN_EFAULT;
		return;
	}
	/* Read before the thread's fields: a hook that moves it after they change follows
	 * the change, so a memo made from fields read before the change is dropped. */
	tepoch = task_epoch;
	if (st->thread_task == cur_task && st->thread_tid == key->tid &&
	    st->thread_epoch == tepoch && st->last_tgid == key->tgid) {
		/* The thread this CPU sampled last, and neither exec, exit nor a cgroup move
		 * anywhere since: its process and cgroup are the memo's, which skips the
		 * leader's lines and the cgroup id's four dependent loads (css_set, cgroup,
		 * kernfs node). */
		key->start_ns = st->last_start_ns;
		key->exec_id = st->last_exec_id;
		key->cgroup_id = st->last_cgroup_id;
	} else {
		leader = task->group_leader;
		key->start_ns = leader->start_boottime;
		key->exec_id = (__u32)leader->self_exec_id;
		key->cgroup_id = bpf_get_current_cgroup_id();
	}
	/* Filled on both paths: stack slots that differ between them would make the
	 * verifier walk the unwinder once for each. */
	pid.tgid = key->tgid;
	pid.exec_id = key->exec_id;
	pid.start_ns = key->start_ns;
	fresh.cgroup_id = key->cgroup_id;
	/* Read before the lookups: a change the sampler makes after them moves it. */
	st->epochs = (__u64)proc_epoch << 32 | cgroup_epoch;
	st->announced = 0;
	st->py_checked = FIRN_PY_UNCHECKED;
	if (st->last_tgid == key->tgid && st->last_exec_id == key->exec_id &&
	    st->last_start_ns == key->start_ns && st->last_cgroup_id == key->cgroup_id &&
	    st->last_epochs == st->epochs) {
		/* This CPU's last sample: announced in this cgroup, and no interpreter. */
		st->announced = 1;
		st->py_checked = FIRN_PY_NATIVE;
	} else {
		was = bpf_map_lookup_elem(&seen, &pid);
		if (!was) {
			if (emit(FIRN_EV_NEW, &pid, key->cgroup_id) == 0) {
				st->announced =
					bpf_map_update_elem(&seen, &pid, &fresh, BPF_ANY) == 0;
			}
		} else if (was->cgroup_id != key->cgroup_id) {
			/* Moved since its last sample: the sampler reads the new cgroup's path if
			 * it has none for this id (within its rate bound). Not urgent: it wakes
			 * nobody. One event per sample at most, so per process at most the
			 * sampling rate. */
			if (emit(FIRN_EV_CGROUP, &pid, key->cgroup_id) == 0) {
				was->cgroup_id = key->cgroup_id;
				__sync_fetch_and_add(&cgroup_epoch, 1);
			}
		} else {
			st->announced = 1;
		}
	}

	if (user_stack(ctx, in_user, task, set, key))
		/* Looked up again, not kept across the walk: a pointer live across it would
		 * double the states the verifier walks the unwinder with. */
		remap(key);
	/* A sample taken in user mode has no kernel stack; asking for one anyway costs a
	 * callchain setup (~2 us on the test VM), so answer as the helper would. */
	if (in_user)
		key->kern_status = -FIRN_EFAULT;
	else
		/* Off CPU: the stack starts in this program and bpf_trace_run4; skipped. */
		kernel_stack(ctx, set, kind == FIRN_KIND_OFF_CPU ? 2 : 0, key);
	/* Looked up again: kept across the walk, the pointer would cost verifier states. */
	st = walk_state(&cpu);
	if (!st)
		return;
	if (st->announced && st->py_checked == FIRN_PY_NATIVE) {
		st->last_tgid = key->tgid;
		st->last_exec_id = key->exec_id;
		st->last_start_ns = key->start_ns;
		st->last_cgroup_id = key->cgroup_id;
		st->last_epochs = st->epochs;
		st->thread_task = cur_task;
		st->thread_tid = key->tid;
		st->thread_epoch = tepoch;
	} else {
		st->last_tgid = 0;
	}
}

SEC("perf_event")
int firn_sample(struct bpf_perf_event_data *ctx)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct firn_sample_key key = {};
	__u32 set = active_set;

	if (task->pid == 0) {
		bump(FIRN_CTR_IDLE);
		return 0;
	}

	bump(FIRN_CTR_SAMPLES);
	key_of(ctx, task, user_mode(ctx), set, FIRN_KIND_CPU, &key);
	if (log_key(set, &key))
		count_key(counts_of(set), &key, 1);
	return 0;
}

#include "offcpu.bpf.h"

/* Current is the task that exec'd, its exec count already one up. */
SEC("raw_tp/sched_process_exec")
int firn_exec(void *ctx)
{
	struct firn_proc_id id;

	(void)ctx;
	__sync_fetch_and_add(&task_epoch, 1);
	proc_id_of((struct task_struct *)bpf_get_current_task(), &id);
	id.exec_id -= 1;
	ended(FIRN_EV_EXEC, &id);
	return 0;
}

/* Current is the exiting thread; the process ends with its last thread. */
SEC("raw_tp/sched_process_exit")
int firn_exit(void *ctx)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct firn_proc_id id;

	(void)ctx;
	/* Every thread: its id may be given to a new thread once it is gone. */
	__sync_fetch_and_add(&task_epoch, 1);
	if (BPF_CORE_READ(task, signal, live.counter) != 0)
		return 0;
	proc_id_of(task, &id);
	ended(FIRN_EV_EXIT, &id);
	return 0;
}

/* Fired after a task or thread group was moved, in any hierarchy (cgroup v1's
 * transfer_tasks moves none in the default one, whose id the keys carry): the thread
 * memos no longer hold. After the move, so a memo made before it is dropped. */
SEC("raw_tp/cgroup_attach_task")
int firn_cgroup_move(void *ctx)
{
	(void)ctx;
	__sync_fetch_and_add(&task_epoch, 1);
	return 0;
}
