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

/* Index of each per-CPU counter in the `counters` map. Those a native sample of a busy
 * thread moves come first, so that they share two cache lines of the map's pointers and
 * of its values: at 99 Hz every line a sample touches is cold again. */
enum firn_counter {
	FIRN_CTR_SAMPLES = 0,          /* program runs that reached the counting step */
	FIRN_CTR_TABLE_FRAMES = 1,     /* user frames unwound with a table row */
	FIRN_CTR_FP_FRAMES = 2,        /* user frames unwound by frame pointers (no row) */
	FIRN_CTR_STACK_WINDOWS = 3,    /* windows of user stack read by the native walk */
	FIRN_CTR_ROW_MEMO_HITS = 4,    /* frames whose row came from the CPU's memo of rows */
	FIRN_CTR_IDLE = 5,             /* samples of the idle task, skipped on purpose */
	FIRN_CTR_USER_STACK_FULL = 6,  /* user stack not stored: stack map full or bucket taken */
	FIRN_CTR_COUNTS_FULL = 7,      /* sample lost: counts map full */
	/* Why each user stack ended: FIRN_CTR_END_BASE + enum firn_unwind_end. */
	FIRN_CTR_END_BASE = 8,
	/* The Python walk (python.bpf.h). */
	FIRN_CTR_PY_FRAMES = 17,       /* Python frames emitted */
	FIRN_CTR_PY_NO_THREAD = 18,    /* no thread state or no current frame for the thread */
	FIRN_CTR_PY_READ_FAULT = 19,   /* a frame or code object could not be read */
	FIRN_CTR_PY_NOT_CODE = 20,     /* a frame's code is not of the record's code type */
	FIRN_CTR_PY_BAD_TYPES = 21,    /* a process's record names types that are not CPython's */
	FIRN_CTR_PY_CODE_COPIED = 22,  /* code objects' names copied for the sampler */
	FIRN_CTR_PY_CODE_FULL = 23,    /* not copied: pycode full until the next drain */
	FIRN_CTR_LOOP_BUDGET = 24,     /* the walk's step budget ran out (Python steps use it) */
	FIRN_CTR_KERN_STACK_FULL = 25, /* kernel stack not stored: stack map full */
	FIRN_CTR_USER_STACK_ERR = 26,  /* user stack read failed with an unexpected error */
	FIRN_CTR_KERN_STACK_ERR = 27,  /* kernel stack read failed with an unexpected error */
	FIRN_CTR_EVENTS = 28,          /* process events written to the ring buffer */
	FIRN_CTR_EVENTS_LOST = 29,     /* process events lost: ring buffer full (retried) */
	/* Off-CPU (with --off-cpu): each wait is timed from a task's switch-out to its
	 * switch-in, where its stacks are taken. */
	FIRN_CTR_OFF_WAITS = 30,       /* waits counted */
	FIRN_CTR_OFF_SHORT = 31,       /* waits under --off-cpu-min-us, skipped */
	FIRN_CTR_OFF_UNSAMPLED = 32,   /* voluntary switches not drawn (added 256 at a time per CPU) */
	FIRN_CTR_OFF_NO_STORAGE = 33,  /* switch-outs not timed: task storage not allocated */
	FIRN_CTR_OFF_NS = 34,          /* off-CPU nanoseconds counted (weighted) */
	FIRN_CTR_OFF_CROSSED = 35,     /* waits counted without stacks: they crossed a round */
	FIRN_CTR_OFF_WEIGHT = 36,      /* switches the taken ones stand for (the sum of their N) */
	FIRN_CTR_LOG_FULL = 37,        /* samples whose CPU's run of the log was full (counted in
					* counts_N instead) */
	FIRN_CTR_MAX = 38,
};

/* Why the unwinder stopped. The last frame was walked with a table row, or (the
 * NO_MAPPING, NO_TABLE and NOT_IN_TABLE reasons) by frame pointers because there was
 * no row, for that reason. The values are on the wire (schema UnwindEnd) and name the
 * sampler's counters: the sampler asserts all three agree. */
enum firn_unwind_end {
	FIRN_END_COMPLETE = 0,     /* a row said the return address is undefined (outermost) */
	FIRN_END_NO_PROCESS = 1,   /* the process's mappings are not in the map yet: leaf only */
	FIRN_END_NO_MAPPING = 2,   /* pc in anonymous executable code (JIT, vDSO): frame pointers */
	FIRN_END_NO_TABLE = 3,     /* the file has no table (not built, refused, evicted) */
	FIRN_END_NOT_IN_TABLE = 4, /* the table has no row for the pc */
	FIRN_END_UNSUPPORTED = 5,  /* the row's CFA rule is one the unwinder cannot follow */
	FIRN_END_READ_FAULT = 6,   /* no longer written: a failed read is a FIRN_END_BAD_FRAME */
	FIRN_END_DEPTH = 7,        /* FIRN_MAX_STACK_DEPTH frames */
	FIRN_END_BAD_FRAME = 8,    /* the caller's frame failed a check (see unwind_step): a
				    * return address that is not code of this process, a frame
				    * outside the stack window, unreadable memory */
	FIRN_END_MAX = 9,
};
_Static_assert(FIRN_CTR_END_BASE + FIRN_END_MAX == FIRN_CTR_PY_FRAMES, "one counter per end");

/* What a counts entry counts: samples on CPU, or nanoseconds off CPU. */
enum firn_sample_kind {
	FIRN_KIND_CPU = 0,
	FIRN_KIND_OFF_CPU = 1,
};

/* What a process event tells the sampler. */
enum firn_event_kind {
	FIRN_EV_NEW = 1,   /* first sample of (tgid, start, exec id): read /proc now */
	FIRN_EV_EXEC = 2,  /* a sampled process exec'd: `exec_id` names what it ran before */
	FIRN_EV_EXIT = 3,  /* a sampled process exited (its last thread) */
	FIRN_EV_CGROUP = 4, /* a seen process was sampled in another cgroup than before */
	FIRN_EV_REMAP = 5,  /* a seen process ran code outside the mappings of its record
			     * (mapped after it was read: its loader was still at work, or
			     * a dlopen): read its mappings again */
};

/* What the program keeps of a process it announced. */
struct firn_seen {
	__u64 cgroup_id;   /* the cgroup v2 id of its last sample */
	__u64 remap_ns;    /* when it last asked for its mappings to be read again */
};

struct firn_sample_key {
	__u32 tgid;
	__u32 tid;
	__u64 start_ns;                  /* group leader's start_boottime: tells pid reuse */
	__u64 user_stack;                /* key in ustacks_N (hash of the frames); 0: none */
	__u64 kern_stack;                /* key in kstacks_N (hash of the frames); 0: none */
	__u32 exec_id;                   /* leader's exec count (low bits): tells an exec */
	__s8 user_status;                /* 0, or -errno: EFAULT none, ENOMEM map full */
	__s8 kern_status;                /* 0, or -errno: EFAULT none, ENOMEM map full */
	__u8 unwind_end;                 /* enum firn_unwind_end */
	__u8 kind;                       /* enum firn_sample_kind: what the count counts */
	__u64 cgroup_id;                 /* the task's cgroup v2 id at the sample */
	char comm[FIRN_TASK_COMM_LEN];   /* thread's comm */
};

_Static_assert(sizeof(struct firn_sample_key) == 64, "firn_sample_key is 64 bytes");

/* A slot of the sample log (`samples` in profile.bpf.c): a key as taken, or free
 * (tgid 0: no sample of tgid 0 is ever taken, the idle task is skipped). */
union firn_log_slot {
	struct firn_sample_key key;
	__u8 line[64];
};

/* A user stack as the unwinder stores it: return addresses, innermost first, ended by 0
 * when shorter than FIRN_MAX_STACK_DEPTH. */
struct firn_user_stack {
	__u64 frames[FIRN_MAX_STACK_DEPTH];
};

/* ---- Unwind tables (built by the enricher, checked and written by the sampler) ---- */

/* How a row finds the canonical frame address (CFA: the caller's stack pointer). */
enum firn_cfa_kind {
	FIRN_CFA_NONE = 0,        /* no row covers this pc (end of a function's code) */
	FIRN_CFA_RSP = 1,         /* CFA = rsp + cfa_offset */
	FIRN_CFA_RBP = 2,         /* CFA = rbp + cfa_offset */
	FIRN_CFA_PLT = 3,         /* CFA = rsp + 8, + 8 when (pc & 15) >= cfa_offset */
	FIRN_CFA_SIGNAL = 4,      /* signal trampoline: registers from the ucontext at rsp */
	FIRN_CFA_UNSUPPORTED = 5, /* a rule the unwinder cannot follow: stop here */
	FIRN_CFA_STOP = 6,        /* return address undefined: the outermost frame */
	FIRN_CFA_KINDS = 7,
};

/* Where the caller's rbp is. */
enum firn_rbp_kind {
	FIRN_RBP_SAME = 0,        /* unchanged */
	FIRN_RBP_AT_CFA = 1,      /* saved at CFA + 8 * rbp_offset8 */
	FIRN_RBP_UNKNOWN = 2,     /* cannot be recovered: later rbp rules fail */
	FIRN_RBP_KINDS = 3,
};

/* One row: from file offset `pc` on (until the next row), this rule holds. A table is
 * a run of rows sorted by pc, strictly increasing. */
struct firn_unwind_row {
	__u32 pc;                 /* offset in the file (the enricher maps vaddr → offset) */
	__u16 cfa_offset;
	__u8 kinds;               /* enum firn_cfa_kind | enum firn_rbp_kind << 4 */
	__s8 rbp_offset8;         /* FIRN_RBP_AT_CFA: offset from the CFA, in 8-byte words */
};
_Static_assert(sizeof(struct firn_unwind_row) == 8, "firn_unwind_row is 8 bytes");

/* The offsets a row may carry are checked by the sampler (schema unwind_row::valid: an
 * rbp-based CFA at most rbp + 256, by what 3,574 ELF files of a Debian node use); the
 * walk itself never trusts them. How far above the stack pointer a frame pointer may
 * lie when the walk uses it as a base (rbp-based CFA, frame-pointer fallback), and a
 * signal frame's saved stack pointer: the walk moves up the stack by bounded steps. */
#define FIRN_MAX_FRAME_BYTES (1 << 20)
#define FIRN_MAX_SIGNAL_FRAME_BYTES (64 << 10)

/* A mapped file as the sampler read it from /proc/PID/maps. */
struct firn_file_key {
	__u64 inode;
	__u32 dev;                /* major << 20 | minor */
	__u32 reserved;
};

/* Where a file's rows are in the `rows` array. */
struct firn_table {
	__u32 first;              /* its rows in `rows`: first .. first + count */
	__u32 count;
	__u32 base;               /* the first row's pc: page 0 starts there */
	__u16 pages;              /* directory entries after the rows (>= 1) */
	__u8 shift;               /* pages are 2^shift bytes */
	__u8 pad;
};

/* A process's executable mappings fit a 2 KiB allocation (the map is not preallocated:
 * the kernel hands out elements in power-of-two sizes, so 64 mappings of 40 bytes took
 * 4 KiB a process). */
#define FIRN_MAX_MAPPINGS 60

struct firn_mapping {
	__u64 start;
	__u32 pages;              /* length, in 4 KiB pages */
	__u32 offset_pages;       /* file offset of `start`, in pages */
	__u64 inode;              /* 0: anonymous executable memory (JIT, vDSO) */
	__u32 dev;                /* major << 20 | minor */
	__u32 reserved;
};
_Static_assert(sizeof(struct firn_mapping) == 32, "firn_mapping is 32 bytes");

/* The executable mappings of one process (its files', then anonymous executable
 * ranges and the vDSO), sorted by start. Every frame above the leaf must lie in one. */
struct firn_proc_maps {
	__u64 start_ns;           /* of the process they belong to: pid reuse and exec */
	__u32 exec_id;
	__u32 count;
	struct firn_mapping m[FIRN_MAX_MAPPINGS];
};
_Static_assert(sizeof(struct firn_proc_maps) <= 2048 - 64, "a 2 KiB element with its header");

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
	__u32 exe_dev;                   /* NEW: the executable's device (kernel dev_t) */
	char comm[FIRN_TASK_COMM_LEN];   /* comm of the thread that triggered it */
	__u64 exe_ino;                   /* NEW: inode of the executable it ran (0: none) */
	__u64 cgroup_id;                 /* NEW, CGROUP: the cgroup v2 id at the sample */
	__u64 start_code;                /* NEW: mm->start_code, where its loader put the
	                                  * executable's code (its load bias + lowest PF_X
	                                  * p_vaddr); 0: none */
	/* NEW: what /proc/<pid>/stat and the directory's owner would say, so that the
	 * sampler reads neither (the record's process comm, parent, user). */
	__u32 ppid;                      /* the parent's tgid */
	__u32 euid;                      /* effective uid (kernel's, not namespaced) */
	__u32 flags;                     /* FIRN_EVF_* */
	__u32 reserved;
	char leader_comm[FIRN_TASK_COMM_LEN]; /* the main thread's comm */
};
_Static_assert(sizeof(struct firn_event) == 96, "firn_event is 96 bytes");

/* linux/sched.h: task_struct.flags of a kernel thread. */
#define FIRN_PF_KTHREAD 0x00200000

/* firn_event.flags */
#define FIRN_EVF_KTHREAD 1               /* a kernel thread: nothing to read in /proc */

/* ---- CPython (python.bpf.h; written by the sampler from a checked record) ---- */

/* A Python frame in a user stack: bit 63 set and bit 62 clear (no user address has
 * either, no kernel address has this pair), a 42-bit code id, the instruction index. */
#define FIRN_PY_TAG (1ULL << 63)
#define FIRN_PY_INDEX_BITS 20
#define FIRN_PY_INDEX_MASK ((1ULL << FIRN_PY_INDEX_BITS) - 1)
#define FIRN_PY_ID_MASK ((1ULL << 42) - 1)
#define FIRN_PY_NONE 0xffff

#define FIRN_PY_POSITION_LASTI 0
#define FIRN_PY_POSITION_POINTER 1
#define FIRN_PY_BOUNDARY_ONE_FRAME 0
#define FIRN_PY_BOUNDARY_IS_ENTRY 1
#define FIRN_PY_BOUNDARY_OWNER 2

/* What the walk reads of a frame and of a code object, at most. */
#define FIRN_PY_FRAME_BUF 128
#define FIRN_PY_CODE_BUF 256
#define FIRN_PY_MAX_THREADS 64
#define FIRN_PY_SEEN_CACHE 16

/* A process's interpreter: the record's fields as addresses of this process. */
struct firn_py_proc {
	__u64 start_ns;
	__u32 exec_id;
	__u8 minor;
	__u8 position;
	__u8 boundary;
	__u8 cstack;
	__u8 types_checked;      /* written by the walk: 0 not yet, 1 CPython's, 2 not */
	__u8 reserved[3];
	__u16 frame_span;        /* bytes of a frame the walk reads (<= FIRN_PY_FRAME_BUF) */
	__u16 code_span;         /* bytes of a code object (<= FIRN_PY_CODE_BUF) */
	__u64 eval_start;
	__u64 eval_end;
	__u64 cold_start;
	__u64 cold_end;
	__u64 runtime;
	__u64 code_type;
	__u64 str_type;
	__u64 bytes_type;
	__u16 runtime_interpreters;
	__u16 interp_threads_head;
	__u16 tstate_next;
	__u16 tstate_thread_id;
	__u16 tstate_frame;
	__u16 cframe_frame;      /* FIRN_PY_NONE: the thread state holds the frame */
	__u16 frame_previous;
	__u16 frame_code;
	__u16 frame_instr;
	__u16 boundary_offset;
	__u16 code_adaptive;
	__u16 code_filename;
	__u16 code_name;
	__u16 code_linetable;
	__u16 code_firstlineno;
	__u16 object_type;
	__u16 type_name;
	__u16 str_state;
	__u16 str_length;
	__u16 str_ascii_data;
	__u16 bytes_size;
	__u16 bytes_data;
};
_Static_assert(sizeof(struct firn_py_proc) == 136, "firn_py_proc is 136 bytes");

#define FIRN_PY_NAME_BYTES 128
#define FIRN_PY_FILE_BYTES 256
#define FIRN_PY_TABLE_BYTES 3584
#define FIRN_PY_CODE_ENTRIES 2048

/* Flags of a copied code object. */
#define FIRN_PY_NAME_CUT 1
#define FIRN_PY_FILE_CUT 2
#define FIRN_PY_TABLE_CUT 4
#define FIRN_PY_NOT_ASCII 8     /* a name or file is not compact ASCII: not copied */
#define FIRN_PY_NOT_STR 16      /* a name or file is not of the str type */
#define FIRN_PY_NOT_BYTES 32    /* the line table is not of the bytes type */

/* What names one code object. Lengths are of the bytes copied; the rest of each array
 * is not part of it. A hash element of this fits the kernel's 4 KiB allocation. */
struct firn_py_code {
	__u64 id;
	__u32 first_line;
	__u16 name_len;
	__u16 file_len;
	__u16 table_len;
	__u8 minor;
	__u8 flags;
	__u32 reserved;
	char name[FIRN_PY_NAME_BYTES];
	char file[FIRN_PY_FILE_BYTES];
	__u8 table[FIRN_PY_TABLE_BYTES];
};
_Static_assert(sizeof(struct firn_py_code) == 3992, "firn_py_code is 3992 bytes");

#endif
