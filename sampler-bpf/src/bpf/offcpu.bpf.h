/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Off-CPU time (with --off-cpu), included by profile.bpf.c after `key_of`. One program
 * on the sched_switch BTF tracepoint, for both ends of a wait.
 *
 * Switch-out: a task leaving a CPU of its own accord (blocked on a lock, a pipe, a
 * socket, disk, asleep; not preempted nor rescheduled while runnable: a runnable task
 * waits for a CPU, not for an event) is
 * still current, in the kernel, with its user registers saved at entry: its stacks are
 * taken there, kernel (why it waits: futex_wait, do_nanosleep, pipe_read ...) and user
 * (the same unwinder as samples), and kept with the time in its task storage.
 * Switch-in: when it is next on a CPU, the time it was away is counted under that key.
 * Kernels without kprobes and fentry (this project's CI VM has neither) have no hook in
 * the returning task's own context, so the stacks cannot wait until the length of the
 * wait is known. To bound the cost, each CPU draws which voluntary switches are taken:
 * one in N at random, its time counted N times (unbiased). N is at least
 * `off_cpu_every` and grows with the CPU's switch rate so that at most `off_cpu_rate`
 * switches a second are taken on it: N for each 100 ms window is set from the switches
 * of the window before, so the probability is known before each draw and the weighted
 * totals stay unbiased. A quiet node takes every wait; a storm that begins within a
 * window doubles N each time the window's share of the rate is taken (so its first
 * window takes at most that share times log2 of the storm's N: ~300 walks at the
 * defaults), and each later window at most its share. A wait under `off_cpu_min_ns` is skipped and counted.
 *
 * A wait that ends in a later round than it began in had its stacks stored in a map
 * set drained since (told by `set_epoch`, which every flip moves): it is counted
 * without stacks (`off_cpu_crossed`).
 * The idle task, kernel threads and the sampler itself are not timed. Task storage is
 * freed with its task: a task that exits while off CPU leaves nothing behind.
 */
#ifndef FIRN_OFFCPU_BPF_H
#define FIRN_OFFCPU_BPF_H

#define FIRN_TASK_RUNNING 0
#define FIRN_ENOENT 2

/* Set by the sampler before loading. */
const volatile __u64 off_cpu_min_ns = 0;
const volatile __u32 off_cpu_every = 1;
/* Taken switches a second per CPU at most (0: no bound but off_cpu_every). */
const volatile __u32 off_cpu_rate = 0;
const volatile __u32 off_cpu_self_tgid = 0;

#define FIRN_OFF_WINDOW_NS 100000000ULL
#define FIRN_OFF_MAX_EVERY 1000000U

/* A wait in progress: since when, in which set (and flip) its stacks are, its weight,
 * its key. */
struct firn_off_wait {
	__u64 since;              /* 0: none */
	__u32 set;
	__u32 epoch;              /* set_epoch when its stacks were stored */
	__u32 weight;             /* the N it was drawn one in */
	__u32 pad;
	struct firn_sample_key key;
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct firn_off_wait);
} off_waits SEC(".maps");

/* Each CPU's draw: the window's start, its switches and its taken ones, and its N. */
struct firn_off_rate {
	__u64 window_start;
	__u32 switches;           /* voluntary switches in this window */
	__u32 taken;              /* taken since N last rose */
	__u32 every;              /* N */
	__u32 rng;                /* xorshift32 state (0: not seeded yet) */
	__u64 not_drawn;          /* switches not taken, not added to the counter yet */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct firn_off_rate);
} off_rate SEC(".maps");

/* Not-drawn switches a CPU adds to its counter at once (and at each window's end):
 * every untaken switch costs no counter lookup of its own. */
#define FIRN_OFF_FLUSH 256

static __always_inline __u32 at_least_every(__u64 n)
{
	if (n > FIRN_OFF_MAX_EVERY)
		n = FIRN_OFF_MAX_EVERY;
	return n < off_cpu_every ? off_cpu_every : (__u32)n;
}

static __always_inline void flush_not_drawn(struct firn_off_rate *r)
{
	if (r->not_drawn) {
		add(FIRN_CTR_OFF_UNSAMPLED, r->not_drawn);
		r->not_drawn = 0;
	}
}

/* Whether this voluntary switch on this CPU is taken, and the N it was drawn one in
 * (0: not taken). N changes only between draws, from what came before them: each
 * draw's probability is known when it is made, so the weighted totals stay unbiased.
 * This runs at every voluntary switch, so it reads the clock at one in 64 and draws
 * from a per-CPU xorshift rather than the kernel's generator, without a division. */
static __always_inline __u32 draw(void)
{
	__u32 zero = 0, per_window, x;
	struct firn_off_rate *r = bpf_map_lookup_elem(&off_rate, &zero);
	__u64 now, n;

	if (!r)
		return 0;
	if (r->rng == 0) {
		r->rng = bpf_get_prandom_u32() | 1;
		r->every = at_least_every(1);
	}
	if (off_cpu_rate != 0) {
		r->switches += 1;
		/* The clock at one switch in 64; but at each of a window's first 64 while N
		 * is raised, so a CPU quiet after a storm drops the storm's N at once. */
		if ((r->switches & 63) == 0 || r->window_start == 0 ||
		    (r->switches < 64 && r->every > off_cpu_every)) {
			now = bpf_ktime_get_ns();
			if (now - r->window_start >= FIRN_OFF_WINDOW_NS) {
				/* The next window's N keeps the last window's switches to the
				 * rate, scaled by how long that window really lasted (a quiet
				 * CPU's may be long). */
				per_window = off_cpu_rate / 10 ? off_cpu_rate / 10 : 1;
				n = r->switches;
				if (r->window_start != 0)
					n = n * FIRN_OFF_WINDOW_NS / (now - r->window_start);
				r->every = at_least_every((n + per_window - 1) / per_window);
				r->window_start = now;
				r->switches = 0;
				r->taken = 0;
				flush_not_drawn(r);
			}
		}
	}
	if (r->every > 1) {
		x = r->rng;
		x ^= x << 13;
		x ^= x >> 17;
		x ^= x << 5;
		r->rng = x;
		/* One in N without a division: x * N / 2^32 is 0 for about 2^32 / N values of
		 * x (off by at most N / 2^32, nothing at these N). */
		if (((__u64)x * r->every) >> 32 != 0) {
			r->not_drawn += 1;
			if (r->not_drawn >= FIRN_OFF_FLUSH)
				flush_not_drawn(r);
			return 0;
		}
	}
	if (off_cpu_rate != 0) {
		/* A storm that begins within a window doubles N each time the window's
		 * share of the rate is spent, rather than waiting for the window's end. */
		per_window = off_cpu_rate / 10 ? off_cpu_rate / 10 : 1;
		r->taken += 1;
		if (r->taken >= per_window) {
			n = r->every;
			r->every = at_least_every(n * 2);
			r->taken = 0;
			return (__u32)n;
		}
	}
	return r->every;
}

/* The end of `next`'s wait, if one was taken. */
static __always_inline void wait_ends(struct task_struct *next)
{
	struct firn_off_wait *w = bpf_task_storage_get(&off_waits, next, 0, 0);
	__u32 set;
	__u64 away;

	/* The clock is read only for a wait that was taken. */
	if (!w || w->since == 0)
		return;
	set = active_set;
	away = bpf_ktime_get_ns() - w->since;
	w->since = 0;
	if (away < off_cpu_min_ns) {
		bump(FIRN_CTR_OFF_SHORT);
		return;
	}
	if (w->set != set || w->epoch != set_epoch) {
		w->key.user_stack = 0;
		w->key.user_status = -FIRN_ENOENT;
		w->key.kern_stack = 0;
		w->key.kern_status = -FIRN_ENOENT;
		w->key.unwind_end = FIRN_END_COMPLETE;
		bump(FIRN_CTR_OFF_CROSSED);
	}
	away *= w->weight ? w->weight : 1;
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
	struct firn_off_wait *w;
	__u32 set, every;

	wait_ends(next);
	/* A task still runnable is not waiting: preempted (the flag), or rescheduled on its
	 * way back to user mode after an interrupt or a syscall (no flag, state RUNNING). */
	if ((ctx[0] & 1) || prev->__state == FIRN_TASK_RUNNING || prev->pid == 0 ||
	    (prev->flags & FIRN_PF_KTHREAD) || (__u32)prev->tgid == off_cpu_self_tgid)
		return 0;
	every = draw();
	if (every == 0)
		return 0;
	w = bpf_task_storage_get(&off_waits, prev, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!w) {
		bump(FIRN_CTR_OFF_NO_STORAGE);
		return 0;
	}
	set = active_set;
	w->epoch = set_epoch;
	__builtin_memset(&w->key, 0, sizeof(w->key));
	key_of(ctx, bpf_get_current_task_btf(), 0, set, FIRN_KIND_OFF_CPU, &w->key);
	w->set = set;
	w->weight = every;
	add(FIRN_CTR_OFF_WEIGHT, every);
	/* After the walk: one wait in N pays for a walk, so its time must not be counted N
	 * times as if every wait had. */
	w->since = bpf_ktime_get_ns();
	return 0;
}

#endif
