// SPDX-License-Identifier: GPL-2.0
/*
 * firn's sampling program. Attached to a cpu-clock perf event on every CPU.
 * Per sample it counts (tgid, tid, start, comm, user stack id, kernel stack id).
 *
 * Draining without double counting: there are two identical map sets (stacks_N and
 * counts_N). `active_set` (in .bss, mmapped by the sampler) says which set the program
 * writes. At a round's end the sampler flips it, waits a grace period far longer than
 * any program run (the program runs in interrupt context, microseconds), then reads
 * and empties the inactive set at leisure. A sample lands in exactly one set, and a
 * stack id always refers to the stack map of its own set.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "profile.bpf.h"

char LICENSE[] SEC("license") = "GPL";

#define STACK_ENTRIES 16384
#define COUNT_ENTRIES 16384

struct stack_map {
	__uint(type, BPF_MAP_TYPE_STACK_TRACE);
	__uint(max_entries, STACK_ENTRIES);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, FIRN_MAX_STACK_DEPTH * sizeof(__u64));
};

struct count_map {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, COUNT_ENTRIES);
	__type(key, struct firn_sample_key);
	__type(value, __u64);
};

struct stack_map stacks_0 SEC(".maps");
struct stack_map stacks_1 SEC(".maps");
struct count_map counts_0 SEC(".maps");
struct count_map counts_1 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FIRN_CTR_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

/* Written by the sampler through the mmapped .bss; read once per sample. */
volatile __u32 active_set = 0;

/* Only to make the key and counter types visible in the skeleton's BTF, so that the
 * sampler's Rust types are generated from this header. */
struct firn_sample_key unused_key = {};
enum firn_counter unused_counter = FIRN_CTR_SAMPLES;

static __always_inline void bump(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&counters, &idx);
	if (v)
		*v += 1;
}

static __always_inline __s32 stack_id(void *ctx, void *map, __u64 flags, __u32 full_ctr, __u32 err_ctr)
{
	long id = bpf_get_stackid(ctx, map, flags);
	if (id >= 0)
		return (__s32)id;
	/* -EFAULT: no stack of this kind for this sample (user-mode sample has no kernel
	 * stack, kernel thread has no user stack). Normal, not a loss. */
	if (id == -FIRN_EFAULT)
		return (__s32)id;
	/* -EEXIST: hash bucket holds another stack; -ENOMEM: map full. */
	if (id == -FIRN_EEXIST || id == -FIRN_ENOMEM)
		bump(full_ctr);
	else
		bump(err_ctr);
	return (__s32)id;
}

/* The context allows only whole 8-byte loads of the saved registers. */
static __always_inline int user_mode(struct bpf_perf_event_data *ctx)
{
	__u64 cs = *(volatile __u64 *)((char *)ctx + __builtin_offsetof(struct pt_regs, cs));
	return (cs & 3) != 0;
}

SEC("perf_event")
int firn_sample(struct bpf_perf_event_data *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32;
	__u32 tid = (__u32)id;
	struct firn_sample_key key = {};
	struct task_struct *task;
	__u64 one = 1, *count;
	__u32 set = active_set;
	void *stacks, *counts;

	if (tid == 0) {
		bump(FIRN_CTR_IDLE);
		return 0;
	}
	bump(FIRN_CTR_SAMPLES);

	if (set == 0) {
		stacks = &stacks_0;
		counts = &counts_0;
	} else {
		stacks = &stacks_1;
		counts = &counts_1;
	}

	task = (struct task_struct *)bpf_get_current_task();
	key.tgid = tgid;
	key.tid = tid;
	key.start_ns = BPF_CORE_READ(task, group_leader, start_boottime);
	bpf_get_current_comm(&key.comm, sizeof(key.comm));
	key.user_stack_id = stack_id(ctx, stacks, BPF_F_USER_STACK,
				     FIRN_CTR_USER_STACK_FULL, FIRN_CTR_USER_STACK_ERR);
	/* A sample taken in user mode has no kernel stack; asking for one anyway costs a
	 * callchain setup (~2 us on the test VM), so answer as the helper would. */
	if (user_mode(ctx))
		key.kern_stack_id = -FIRN_EFAULT;
	else
		key.kern_stack_id = stack_id(ctx, stacks, 0,
					     FIRN_CTR_KERN_STACK_FULL, FIRN_CTR_KERN_STACK_ERR);

	count = bpf_map_lookup_elem(counts, &key);
	if (count) {
		__sync_fetch_and_add(count, 1);
		return 0;
	}
	if (bpf_map_update_elem(counts, &key, &one, BPF_NOEXIST) != 0) {
		/* Another CPU may have inserted the same key meanwhile. */
		count = bpf_map_lookup_elem(counts, &key);
		if (count)
			__sync_fetch_and_add(count, 1);
		else
			bump(FIRN_CTR_COUNTS_FULL);
	}
	return 0;
}
