/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The unwinder's walk state (unwind.bpf.h): what one walk holds and what a CPU remembers
 * between walks, laid out by use, on a page of its own per CPU (`scratch`).
 */
#ifndef FIRN_WALK_STATE_BPF_H
#define FIRN_WALK_STATE_BPF_H

/* Bytes of the process's stack read at once (a power of two): the walk's reads of a
 * frame and of its next callers mostly lie within it, so one helper call serves them. */
#define FIRN_STACK_WINDOW 512
/* Bytes a new window starts below the word asked for, where the frame allows: a table
 * frame reads its return address at CFA - 8 first and its saved rbp just below. */
#define FIRN_STACK_WINDOW_BELOW 64
_Static_assert((FIRN_STACK_WINDOW & (FIRN_STACK_WINDOW - 1)) == 0 && FIRN_STACK_WINDOW <= 4096 &&
		       FIRN_STACK_WINDOW_BELOW < FIRN_STACK_WINDOW && (FIRN_STACK_WINDOW_BELOW & 7) == 0,
	       "a window is a power of two within a page, and the word asked for lies in it");

/* Entries of the per-CPU memo of stored user stacks (a power of two). */
#define FIRN_STORED_MEMO 16
/* Entries of the per-CPU memo of resolved mappings (a power of two): a native stack
 * mostly spans the program, libc and the loader's start. */
#define FIRN_MAPPING_MEMO 4

/* Entries of the per-CPU memo of rows found (a power of two): a busy thread's stacks
 * repeat a few dozen frames, the leaf's pcs and its callers' return addresses. */
#define FIRN_ROW_MEMO 64
/* No table's run starts here (the pool has fewer rows): an empty entry of the memo. */
#define FIRN_ROW_MEMO_EMPTY 0xffffffffU

/* What find_row answered for an offset in the table whose run starts at `first`: the
 * row, or 0 (no row at or below the offset). */
struct firn_row_memo {
	__u32 first;
	__u32 off;
	__u64 row;
};

/* A mapping as find_mapping resolved it, with its table's run of rows. */
struct firn_mapping_memo {
	__u64 start;
	__u64 end;
	__u64 offset;
	__u32 first;
	__u32 count;
	__u32 base;
	__u16 pages;
	__u8 shift;
	__u8 kind;                 /* enum firn_mapping_kind; 0: empty */
};

/* A user stack this CPU stored or found lately, with the set and set_epoch it went to
 * (tag = epoch << 1 | set): side by side, so a lookup reads one line. */
struct firn_stored_memo {
	__u64 hash;
	__u64 tag;
};

/* The walk of one stack, per CPU. A map value, not the BPF stack: the verifier sees
 * every field as unknown and checks the bpf_loop callback once, not per frame count.
 * By use: at 99 Hz each line a sample touches is cold again, so what every native
 * sample touches comes first, then the first frames, then the rest. */
struct firn_unwind_state {
	/* -- every sample: the walk's registers and its process -- */
	__u64 pc;
	__u64 sp;
	__u64 bp;
	__u64 hash;
	__u64 start_ns;
	__u32 tgid;
	__u32 exec_id;
	__u32 len;
	__u32 end;
	__u8 bp_known;
	__u8 exact_pc;             /* pc is where execution stopped, not a return address */
	__u8 fp_why;               /* the last frame was walked by frame pointers, for this
				    * firn_unwind_end (0: by a row) */
	/* The mapping of the last frame and its table: consecutive frames are mostly in
	 * one binary, so most frames skip two hash lookups and the mapping search. */
	__u8 cached;               /* 0: nothing cached; else enum firn_mapping_kind */
	__u8 unmapped;             /* 1: the leaf or a frame reached by a row lay in no
				    * executable mapping of the record (code mapped after it
				    * was read); 2: the record was cut to FIRN_MAX_MAPPINGS,
				    * so a miss says nothing and asks for no read */
	__u8 py_state;             /* enum firn_py_state */
	__u8 py_walking;           /* the next steps are Python frames of one eval call */
	__u8 py_skip_native;       /* what the next native step does with an eval frame
				    * whose Python frames were walked (enum firn_py_after) */
	__u64 c_start;
	__u64 c_end;
	__u64 c_offset;
	__u32 c_first;
	__u32 c_count;
	__u32 c_base;              /* the table's page directory (struct firn_table) */
	__u16 c_pages;
	__u8 c_shift;
	__u8 stopped;              /* a step ended the walk (not the step budget) */
	/* The stack window (below): its start and length (0: none). */
	__u64 win_base;
	__u32 win_len;
	__u16 win_reads;           /* windows this walk read, counted once */
	__u16 row_memo_hits;       /* frames this walk found in the memo, counted once */
	/* Native frames this walk unwound by a row and by frame pointers, counted once. */
	__u16 table_frames;
	__u16 fp_frames;
	__u32 tid;
	/* The process this CPU sampled last, if it was announced (in `seen` with the cgroup
	 * below) and has no interpreter in `pyprocs`, under the epochs below: its next
	 * sample here skips both lookups (key_of). */
	__u64 last_start_ns;
	__u64 last_cgroup_id;
	__u64 last_epochs;
	__u32 last_tgid;
	__u32 last_exec_id;
	/* The thread of that sample (its task and tid; its tgid is last_tgid) under
	 * task_epoch's value: its next sample here takes the process and cgroup above
	 * without reading them. The tid is not implied by the task and the epoch: a memo
	 * can be written after the exit hook moved the epoch (the dead task's last switch,
	 * a sample in do_exit's later steps), and the freed task's memory can come back as
	 * a new thread of the same process, which moves no epoch; tids are handed out
	 * cyclically, so the new thread's differs. */
	__u64 thread_task;
	__u32 thread_tid;
	__u32 thread_epoch;
	/* This sample's: the epochs read before its lookups, whether it was announced, and
	 * what it found in `pyprocs` (enum firn_py_checked). */
	__u64 epochs;
	__u8 announced;
	__u8 py_checked;
	__u16 pad0;
	__u32 py_frames;           /* Python frames this walk emitted (counted once) */
	/* Tags of the memos of mappings and rows (below). */
	__u64 memo_start_ns;
	__u64 memo_epoch;
	__u32 memo_tgid;
	__u32 memo_exec_id;
	__u32 memo_next;
	__u32 pad1;
	__u64 row_memo_tag;
	/* The slot after the one this CPU wrote last in each set's run of the log. */
	__u32 log_next[2];
	/* -- the stack, innermost first: a native stack's first frames follow -- */
	struct firn_user_stack stack;
	/* -- what some samples or frames touch -- */
	/* User stacks this CPU stored or found lately: a repeat skips the stack map. */
	struct firn_stored_memo stored[FIRN_STORED_MEMO];
	/* Mappings this CPU resolved for the process above (memo_*), under proc_epoch's value
	 * there (the sampler moves it after every change of procmaps or tables): a frame in
	 * one skips procmaps, the search of its mappings and tables, across samples. */
	struct firn_mapping_memo mapping_memo[FIRN_MAPPING_MEMO];
	/* Rows this CPU found lately, for any process (a file's table is every process's),
	 * while proc_epoch is row_memo_tag - 1: the sampler moves it after a table is
	 * removed or replaced and before its run of rows can go to another file. A frame
	 * found here skips the table's directory and rows (a few cache lines and pages of
	 * `rows`, cold again 10 ms after the last sample). */
	struct firn_row_memo row_memo[FIRN_ROW_MEMO];
	/* A copy of the stack from win_base up, win_len bytes, read in this walk
	 * (read_stack). Never leaves BPF: the walk takes from it the words it would have
	 * read one by one, and no others. */
	__u64 win[FIRN_STACK_WINDOW / 8];
	/* The Python walk (python.bpf.h). */
	__u32 py_call_frames;      /* Python frames of the eval call being walked */
	__u32 pad2;
	__u64 py_frame;            /* the next Python frame to emit (0: none left) */
	__u64 py_hash;             /* seeded, of the process: code ids are per process */
	/* Code ids this CPU copied or found in pyseen lately (a per-CPU value outlives the
	 * walk), valid while seen_epoch is pyepoch's: most frames skip the pyseen lookup. */
	__u64 seen_epoch;
	__u64 seen_ids[FIRN_PY_SEEN_CACHE];
	struct firn_py_proc py;
	__u8 frame_buf[FIRN_PY_FRAME_BUF];
	__u8 code_buf[FIRN_PY_CODE_BUF];
};

enum firn_py_checked {
	FIRN_PY_UNCHECKED = 0,        /* the walk stopped before it looked */
	FIRN_PY_NATIVE = 1,           /* no interpreter for the process */
	FIRN_PY_INTERPRETER = 2,
};

enum firn_py_after {
	FIRN_PY_AFTER_NONE = 0,       /* not an eval frame just walked */
	FIRN_PY_AFTER_UNRECORDED = 1, /* its Python frames stand in for it */
	FIRN_PY_AFTER_RECORDED = 2,   /* none were emitted: it stays, not walked again */
};

enum firn_py_state {
	FIRN_PY_STATE_NONE = 0,     /* no interpreter known for the process */
	FIRN_PY_STATE_UNLOOKED = 1, /* known; the thread's frames not looked up yet */
	FIRN_PY_STATE_LOOKED = 2,
};

/* Steps of one walk: native and Python frames, shim frames and the eval frames that
 * Python frames replace. */
#define FIRN_UNWIND_STEPS 256

/* A CPU's walk state on a page of its own. */
union firn_scratch_page {
	struct firn_unwind_state st;
	__u8 page[4096];
};
_Static_assert(sizeof(struct firn_unwind_state) <= 4096, "the walk state fits its page");

/* The walk states, one per possible CPU (the sampler sets max_entries before load),
 * indexed by the CPU the program runs on. Not a per-CPU array: that one's values are
 * only 8-byte aligned, so the state's lines fall differently at each load and it spans
 * two pages nearly always; an mmapable array's values are page-aligned. Each CPU's
 * entry is used exactly as its per-CPU value was: by the CPU the program runs on, which
 * does not change while it runs. Mmapable, yet mapped by no one: only the sampler holds
 * the fd, and it never reads the entries (the stack windows they hold stay in BPF). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, union firn_scratch_page);
} scratch SEC(".maps");

/* This CPU's walk state (never NULL with max_entries set to the possible CPUs). An
 * array lookup by a stack key is inlined by the verifier into a bound check and an
 * address: no load of the map's per-CPU pointers as a per-CPU array's is. `cpu` is the
 * caller's, one per function: a slot of its own at each call would leave the stacks of
 * two paths different, and the verifier walks the unwinder once for each (2x its
 * instructions when tried). */
static __always_inline struct firn_unwind_state *walk_state(__u32 *cpu)
{
	*cpu = bpf_get_smp_processor_id();
	return (struct firn_unwind_state *)bpf_map_lookup_elem(&scratch, cpu);
}

#endif
