/* Shared between the BPF program and the sampler (via the generated skeleton types). */
#ifndef FIRN_PROFILE_BPF_H
#define FIRN_PROFILE_BPF_H

#define FIRN_TASK_COMM_LEN 16
#define FIRN_MAX_STACK_DEPTH 127

/* Errors of bpf_get_stackid the program tells apart (Linux errno values; vmlinux.h
 * has no errno macros). The sampler names them with libc's constants. */
#define FIRN_ENOMEM 12  /* stack map full */
#define FIRN_EFAULT 14  /* no stack of this kind for this sample */
#define FIRN_EEXIST 17  /* stack map bucket holds another stack */

/* Index of each per-CPU counter in the `counters` map. */
enum firn_counter {
	FIRN_CTR_SAMPLES = 0,          /* program runs that reached the counting step */
	FIRN_CTR_IDLE = 1,             /* samples of the idle task, skipped on purpose */
	FIRN_CTR_USER_STACK_FULL = 2,  /* user stack not stored: stack map full or bucket taken */
	FIRN_CTR_KERN_STACK_FULL = 3,  /* kernel stack not stored: stack map full or bucket taken */
	FIRN_CTR_USER_STACK_ERR = 4,   /* user stack read failed with an unexpected error */
	FIRN_CTR_KERN_STACK_ERR = 5,   /* kernel stack read failed with an unexpected error */
	FIRN_CTR_COUNTS_FULL = 6,      /* sample lost: counts map full */
	FIRN_CTR_EVENTS = 7,           /* process events written to the ring buffer */
	FIRN_CTR_EVENTS_LOST = 8,      /* process events lost: ring buffer full (retried) */
	FIRN_CTR_MAX = 9,
};

/* What a process event tells the sampler. */
enum firn_event_kind {
	FIRN_EV_NEW = 1,   /* first sample of (tgid, start, exec id): read /proc now */
	FIRN_EV_EXEC = 2,  /* a sampled process exec'd: `exec_id` names what it ran before */
	FIRN_EV_EXIT = 3,  /* a sampled process exited (its last thread) */
};

struct firn_sample_key {
	__u32 tgid;
	__u32 tid;
	__u64 start_ns;                  /* group leader's start_boottime: tells pid reuse */
	__s32 user_stack_id;             /* >= 0, or -errno */
	__s32 kern_stack_id;             /* >= 0, or -errno */
	__u32 exec_id;                   /* leader's exec count (low bits): tells an exec */
	__u32 reserved;
	char comm[FIRN_TASK_COMM_LEN];   /* thread's comm */
};

/* The sampler reads this layout through the skeleton's generated `firn_sample_key`
 * (from the program's BTF): one definition, here. The size is part of the contract with
 * the batched map drain, so a change must be deliberate. */
_Static_assert(sizeof(struct firn_sample_key) == 48, "firn_sample_key is 48 bytes");

/* One process as the program tells them apart: pid reuse changes start_ns, exec
 * changes exec_id. Key of the `seen` LRU map. */
struct firn_proc_id {
	__u32 tgid;
	__u32 exec_id;
	__u64 start_ns;
};

/* A record of the `events` ring buffer. */
struct firn_event {
	__u32 kind;                      /* enum firn_event_kind */
	__u32 tgid;
	__u64 start_ns;
	__u32 exec_id;
	__u32 reserved;
	char comm[FIRN_TASK_COMM_LEN];   /* comm of the thread that triggered it */
	__u64 exe_ino;                   /* NEW: inode of the executable it ran (0: none) */
};
_Static_assert(sizeof(struct firn_event) == 48, "firn_event is 48 bytes");

#endif
