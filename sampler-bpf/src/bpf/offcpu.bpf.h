/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Off-CPU time (with --off-cpu), included by profile.bpf.c after `key_of`. One program
 * on the sched_switch BTF tracepoint, for both ends of a wait.
 *
 * Switch-out: a task leaving a CPU of its own accord (blocked on a lock, a pipe, a
 * socket, disk, asleep; not preempted: a preempted task is runnable, not waiting) is
 * still current, in the kernel, with its user registers saved at entry: its stacks are
 * taken there, kernel (why it waits: futex_wait, do_nanosleep, pipe_read ...) and user
 * (the same unwinder as samples), and kept with the time in its task storage.
 * Switch-in: when it is next on a CPU, the time it was away is counted under that key.
 * Kernels without kprobes and fentry (this project's CI VM has neither) have no hook in
 * the returning task's own context, so the stacks cannot wait until the length of the
 * wait is known: to bound the cost, one voluntary switch in `off_cpu_every` is taken
 * (at random) and its time counted that many times (unbiased); a wait under
 * `off_cpu_min_ns` is skipped and counted.
 *
 * A wait that ends in a later round than it began in had its stacks stored in a map
 * set drained since (told by `set_epoch`, which every flip moves): it is counted
 * without stacks (`off_cpu_crossed`).
 * The idle task, kernel threads and the sampler itself are not timed. Task storage is
 * freed with its task: a task that exits while off CPU leaves nothing behind.
 */
#ifndef FIRN_OFFCPU_BPF_H
#define FIRN_OFFCPU_BPF_H

#define FIRN_PF_KTHREAD 0x00200000
#define FIRN_ENOENT 2

/* Set by the sampler before loading. */
const volatile __u64 off_cpu_min_ns = 0;
const volatile __u32 off_cpu_every = 1;
const volatile __u32 off_cpu_self_tgid = 0;

/* A wait in progress: since when, in which set (and flip) its stacks are, its key. */
struct firn_off_wait {
	__u64 since;              /* 0: none */
	__u32 set;
	__u32 epoch;              /* set_epoch when its stacks were stored */
	struct firn_sample_key key;
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct firn_off_wait);
} off_waits SEC(".maps");

/* The end of `next`'s wait, if one was taken. */
static __always_inline void wait_ends(struct task_struct *next, __u64 now)
{
	struct firn_off_wait *w = bpf_task_storage_get(&off_waits, next, 0, 0);
	__u32 set = active_set;
	__u64 away;

	if (!w || w->since == 0)
		return;
	away = now - w->since;
	w->since = 0;
	if (away < off_cpu_min_ns) {
		bump(FIRN_CTR_OFF_SHORT);
		return;
	}
	if (w->set != set || w->epoch != set_epoch) {
		w->key.user_stack = 0;
		w->key.user_status = -FIRN_ENOENT;
		w->key.kern_stack_id = -FIRN_ENOENT;
		w->key.unwind_end = FIRN_END_COMPLETE;
		bump(FIRN_CTR_OFF_CROSSED);
	}
	away *= off_cpu_every;
	bump(FIRN_CTR_OFF_WAITS);
	add(FIRN_CTR_OFF_NS, away);
	count_key(set == 0 ? (void *)&offcounts_0 : (void *)&offcounts_1, &w->key, away);
}

/* sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next, ...) */
SEC("tp_btf/sched_switch")
int firn_switch(unsigned long long *ctx)
{
	struct task_struct *prev = (struct task_struct *)ctx[1];
	struct task_struct *next = (struct task_struct *)ctx[2];
	__u64 now = bpf_ktime_get_ns();
	struct firn_off_wait *w;
	__u32 set;

	wait_ends(next, now);
	if ((ctx[0] & 1) || prev->pid == 0 || (prev->flags & FIRN_PF_KTHREAD) ||
	    (__u32)prev->tgid == off_cpu_self_tgid)
		return 0;
	if (off_cpu_every > 1 && bpf_get_prandom_u32() % off_cpu_every != 0) {
		bump(FIRN_CTR_OFF_UNSAMPLED);
		return 0;
	}
	w = bpf_task_storage_get(&off_waits, prev, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!w) {
		bump(FIRN_CTR_OFF_NO_STORAGE);
		return 0;
	}
	set = active_set;
	w->epoch = set_epoch;
	__builtin_memset(&w->key, 0, sizeof(w->key));
	key_of(ctx, 0, set, FIRN_KIND_OFF_CPU, &w->key);
	w->set = set;
	w->since = bpf_ktime_get_ns();
	return 0;
}

#endif
