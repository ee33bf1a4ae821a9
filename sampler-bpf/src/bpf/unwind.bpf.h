/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The user-stack unwinder of profile.bpf.c, included there once (it uses that file's
 * counters and `bump`). Per frame: the process's executable mappings
 * (`procmaps`, written by the sampler from /proc/PID/maps) give the file and offset of
 * the pc; the file's table (`tables` → a run of `rows`, built by the enricher from the
 * file's CFI and checked by the sampler) gives the rule for the caller's stack pointer,
 * return address and rbp. Where there is no row the frame is walked by frame pointers.
 * Every frame above the leaf must lie in an executable mapping of the process, and every
 * word the walk uses lies in a bounded window above the frame's stack pointer (DESIGN
 * rule 9); the stack is copied in windows of FIRN_STACK_WINDOW bytes around such words
 * (read_stack), never below the stack pointer.
 */
#ifndef FIRN_UNWIND_BPF_H
#define FIRN_UNWIND_BPF_H

/* First address above user space (x86_64, 4-level paging; 5-level is larger still, and
 * an address above 47 bits is then only cut short, never wrong). */
#define USER_SPACE_END (1ULL << 47)

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
	/* -- the stack, innermost first: a native stack's first frames follow -- */
	struct firn_user_stack stack;
	/* -- what some samples or frames touch -- */
	/* User stacks this CPU stored or found lately: a repeat skips the stack map. */
	struct firn_stored_memo stored[FIRN_STORED_MEMO];
	/* Mappings this CPU resolved for the process above (memo_*), under procepoch's value
	 * there (the sampler moves it after every change of procmaps or tables): a frame in
	 * one skips procmaps, the search of its mappings and tables, across samples. */
	struct firn_mapping_memo mapping_memo[FIRN_MAPPING_MEMO];
	/* Rows this CPU found lately, for any process (a file's table is every process's),
	 * while procepoch is row_memo_tag - 1: the sampler moves it after a table is
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

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct firn_unwind_state);
} scratch SEC(".maps");

/* Written by the sampler before load (random): user stacks are keyed by a hash no
 * local user can predict, so none can craft frames that take another stack's key. */
const volatile __u64 hash_seed = 0;

static __always_inline __u64 mix(__u64 h, __u64 v)
{
	h ^= v;
	h *= 0x100000001b3ULL;
	return h ^ (h >> 29);
}

#include "mappings.bpf.h"

/* Reads a word of the process's stack. Only 8-byte aligned words are read: a row or a
 * frame pointer can then never make the walk read a word made of the bytes of two. */
static __always_inline int read_user(__u64 *dst, __u64 addr)
{
	if (addr & 7)
		return -1;
	return bpf_probe_read_user(dst, sizeof(*dst), (const void *)addr);
}

/* Reads a word of the stack being walked, as read_user does, through this walk's window:
 * a word within it is taken from the copy; else a new window is read, from up to
 * FIRN_STACK_WINDOW_BELOW bytes below `addr` (never below the frame's stack pointer nor
 * addr's page) for FIRN_STACK_WINDOW bytes, or to the end of that page when the next
 * page cannot be read (the top of the stack). Every caller checks `addr` exactly as it
 * would for read_user, with st->sp the stack pointer of the frame being walked; the
 * window only saves helper calls. Bytes of the window the walk does not ask for are
 * never used (DESIGN rule 9). */
static __always_inline int read_stack(struct firn_unwind_state *st, __u64 *dst, __u64 addr)
{
	__u64 off = addr - st->win_base, base;
	__u32 n;

	if (addr & 7)
		return -1;
	/* win_len and off are whole words: off < win_len leaves room for this one. */
	if (off < st->win_len) {
		*dst = st->win[(off >> 3) & (FIRN_STACK_WINDOW / 8 - 1)];
		return 0;
	}
	st->win_reads++;
	base = addr - FIRN_STACK_WINDOW_BELOW;
	if (addr < FIRN_STACK_WINDOW_BELOW || base < st->sp)
		/* The first whole word at or above the stack pointer: at most addr. */
		base = (st->sp + 7) & ~7ULL;
	if (base < (addr & ~4095ULL))
		base = addr & ~4095ULL;
	if (base > addr)
		/* Callers read at or above the stack pointer; else, as read_user would. */
		base = addr;
	st->win_base = base;
	st->win_len = FIRN_STACK_WINDOW;
	if (bpf_probe_read_user(st->win, FIRN_STACK_WINDOW, (const void *)base)) {
		/* base and addr share a page, whose end lies past addr. */
		n = 4096 - (base & 4095);
		if (n >= FIRN_STACK_WINDOW ||
		    bpf_probe_read_user(st->win, n & (FIRN_STACK_WINDOW - 8), (const void *)base)) {
			/* addr's own page cannot be read. */
			st->win_len = 0;
			return -1;
		}
		st->win_len = n & (FIRN_STACK_WINDOW - 8);
	}
	off = addr - base;
	if (off >= st->win_len) {
		st->win_len = 0;
		return -1;
	}
	*dst = st->win[(off >> 3) & (FIRN_STACK_WINDOW / 8 - 1)];
	return 0;
}

/* Whether `base` may serve as a frame's base: 8-byte aligned, at or above the stack
 * pointer and within one frame's reach of it. */
static __always_inline int in_frame(__u64 base, __u64 sp, __u64 reach)
{
	return (base & 7) == 0 && base >= sp && base - sp <= reach;
}

#include "python.bpf.h"

/* One frame: check that st->pc is code of this process (every frame but the leaf, whose
 * pc is the sampled register), record it, then find the caller's registers. Nothing
 * read from the process's memory becomes a frame unless it lies in one of its
 * executable mappings, and every word it uses lies in a bounded window above the stack
 * pointer of the frame being walked (read_stack copies at most FIRN_STACK_WINDOW bytes
 * around it, none below that stack pointer), so a lying table can pick among the
 * process's code addresses and nothing else (DESIGN rule 9). 1 stops the loop. */
static __always_inline long walk_step(struct firn_unwind_state *st)
{
	struct firn_unwind_row row = {};
	__u32 len, why, kind;
	__u64 cfa, ra, bp, sp, pc;
	__u8 cfa_kind, rbp_kind;

	if (st->py_walking)
		return python_step(st);
	len = st->len;
	pc = st->pc;
	if (len >= FIRN_MAX_STACK_DEPTH) {
		st->end = FIRN_END_DEPTH;
		return 1;
	}
	kind = find_mapping(st, pc);
	/* A frame pointer's guess outside the mappings is mostly a frameless caller's
	 * register, not new code: only the leaf and rows' frames ask for a read. */
	if (kind == MAPPING_NONE && st->unmapped == 0 && (len == 0 || !st->fp_why))
		st->unmapped = 1;
	if (len > 0 && kind >= MAPPING_NONE) {
		/* A return address outside every executable mapping of the process: not
		 * recorded. Reached by frame pointers (no row), the walk ended for the reason
		 * it had no row; reached by a row, the row was wrong or the code was mapped
		 * after the record was read (the sampler reads the mappings again). */
		st->end = st->fp_why ? st->fp_why : FIRN_END_BAD_FRAME;
		return 1;
	}
	/* An eval loop's frame: its Python frames first (the following steps), then this
	 * frame is unwound in place without being recorded, as the peers show it. */
	if (st->py_skip_native == FIRN_PY_AFTER_UNRECORDED) {
		st->py_skip_native = FIRN_PY_AFTER_NONE;
	} else if (st->py_skip_native == FIRN_PY_AFTER_NONE && st->py_state && kind < MAPPING_NONE &&
		   in_eval(&st->py, st->exact_pc ? pc : pc - 1) && python_enter(st, st->tid)) {
		return 0;
	} else {
		st->py_skip_native = FIRN_PY_AFTER_NONE;
		st->stack.frames[len] = pc;
		st->len = len + 1;
		st->hash = mix(st->hash, pc);
	}
	if (st->len >= FIRN_MAX_STACK_DEPTH) {
		st->end = FIRN_END_DEPTH;
		return 1;
	}
	if (kind == MAPPING_NO_PROCESS) {
		/* No frame above the leaf could be checked. */
		st->end = FIRN_END_NO_PROCESS;
		return 1;
	}

	why = FIRN_END_NO_MAPPING;
	if (kind == MAPPING_FILE)
		why = FIRN_END_NO_TABLE;
	else if (kind == MAPPING_FILE_TABLE)
		/* A return address points after the call: look up the call itself. */
		why = find_row(st, st->exact_pc ? pc : pc - 1, &row);
	st->exact_pc = 0;
	sp = st->sp;
	st->fp_why = why;
	if (why != 0) {
		/* Frame pointers: [rbp] is the caller's rbp, [rbp + 8] the return address. */
		st->fp_frames++;
		st->end = why;
		if (!st->bp_known || !in_frame(st->bp, sp, FIRN_MAX_FRAME_BYTES))
			return 1;
		if (read_stack(st, &bp, st->bp) || read_stack(st, &ra, st->bp + 8))
			return 1;
		st->sp = st->bp + 16;
		st->bp = bp;
		st->pc = ra;
		return ra < 4096 || ra >= USER_SPACE_END;
	}

	st->table_frames++;
	cfa_kind = row.kinds & 0xf;
	rbp_kind = row.kinds >> 4;
	switch (cfa_kind) {
	case FIRN_CFA_RSP:
		cfa = sp + row.cfa_offset;
		break;
	case FIRN_CFA_RBP:
		if (!st->bp_known) {
			st->end = FIRN_END_UNSUPPORTED;
			return 1;
		}
		if (!in_frame(st->bp, sp, FIRN_MAX_FRAME_BYTES)) {
			st->end = FIRN_END_BAD_FRAME;
			return 1;
		}
		cfa = st->bp + row.cfa_offset;
		break;
	case FIRN_CFA_PLT:
		cfa = sp + 8 + ((pc & 15) >= row.cfa_offset ? 8 : 0);
		break;
	case FIRN_CFA_SIGNAL:
		/* rt_sigframe: the ucontext is at rsp, its sigcontext 40 bytes in; rbp, rsp
		 * and rip are its 11th, 16th and 17th words. The interrupted stack pointer
		 * lies above the frame (a handler on an alternate stack ends the walk). */
		if (read_stack(st, &bp, sp + 40 + 80) || read_stack(st, &cfa, sp + 40 + 120) ||
		    read_stack(st, &ra, sp + 40 + 128) || cfa <= sp ||
		    !in_frame(cfa, sp, FIRN_MAX_SIGNAL_FRAME_BYTES)) {
			st->end = FIRN_END_BAD_FRAME;
			return 1;
		}
		st->bp = bp;
		st->bp_known = 1;
		st->sp = cfa;
		st->pc = ra;
		st->exact_pc = 1;
		st->end = FIRN_END_COMPLETE;
		return ra < 4096 || ra >= USER_SPACE_END;
	case FIRN_CFA_STOP:
		st->end = FIRN_END_COMPLETE;
		return 1;
	default:
		st->end = FIRN_END_UNSUPPORTED;
		return 1;
	}
	/* The caller's frame lies above this one: its return address at CFA - 8, at or
	 * above the stack pointer, and a saved rbp between the two. */
	if (cfa <= sp || (cfa & 7) || read_stack(st, &ra, cfa - 8)) {
		st->end = FIRN_END_BAD_FRAME;
		return 1;
	}
	if (rbp_kind == FIRN_RBP_AT_CFA) {
		__u64 slot = cfa + (__s64)row.rbp_offset8 * 8;

		/* Below the stack pointer lies dead stack, never read. A real row says so
		 * only just after an epilogue's pop, when rbp already holds that value. */
		if (slot >= sp) {
			if (read_stack(st, &bp, slot)) {
				st->end = FIRN_END_BAD_FRAME;
				return 1;
			}
			st->bp = bp;
			st->bp_known = 1;
		}
	} else if (rbp_kind != FIRN_RBP_SAME) {
		st->bp_known = 0;
	}
	st->sp = cfa;
	st->pc = ra;
	st->end = FIRN_END_COMPLETE;
	return ra < 4096 || ra >= USER_SPACE_END;
}

static long unwind_step(__u32 i, void *data)
{
	struct firn_unwind_state *st;
	__u32 zero = 0;
	long r;

	(void)i;
	(void)data;
	st = bpf_map_lookup_elem(&scratch, &zero);
	if (!st)
		return 1;
	r = walk_step(st);
	if (r)
		st->stopped = 1;
	return r;
}

/* Unwinds the user stack of the current task into ustacks (`set`), fills the key's
 * user_stack, user_status and unwind_end. `in_user`: `ctx` is a perf event's, taken in
 * user mode, and holds the user registers; else they are the ones saved at entry.
 * Returns 1 when a frame lay in no executable mapping the process's record names. */
static __always_inline int user_stack(void *ctx, int in_user, struct task_struct *task,
				      __u32 set, struct firn_sample_key *key)
{
	struct firn_unwind_state *st;
	struct firn_py_proc *py;
	struct pt_regs *regs;
	__u32 zero = 0, len, memo;
	void *ustacks;
	long steps;
	__u64 tag;

	st = bpf_map_lookup_elem(&scratch, &zero);
	/* A sample taken in user mode has an mm; a kernel thread has none. */
	if (!st || (!in_user && !task->mm)) {
		key->user_status = -FIRN_EFAULT;
		return 0;
	}
	if (in_user) {
		st->pc = *(volatile __u64 *)((char *)ctx + __builtin_offsetof(struct pt_regs, ip));
		st->sp = *(volatile __u64 *)((char *)ctx + __builtin_offsetof(struct pt_regs, sp));
		st->bp = *(volatile __u64 *)((char *)ctx + __builtin_offsetof(struct pt_regs, bp));
	} else {
		/* In the kernel: the user registers saved at entry. */
		regs = (struct pt_regs *)bpf_task_pt_regs(task);
		st->pc = BPF_CORE_READ(regs, ip);
		st->sp = BPF_CORE_READ(regs, sp);
		st->bp = BPF_CORE_READ(regs, bp);
	}
	if (st->pc == 0 || st->pc >= USER_SPACE_END) {
		key->user_status = -FIRN_EFAULT;
		return 0;
	}
	st->tgid = key->tgid;
	st->start_ns = key->start_ns;
	st->exec_id = key->exec_id;
	/* The memo of mappings holds for one process under one procepoch (key_of read it). */
	if (st->memo_tgid != st->tgid || st->memo_start_ns != st->start_ns ||
	    st->memo_exec_id != st->exec_id || st->memo_epoch != st->epochs >> 32) {
		for (memo = 0; memo < FIRN_MAPPING_MEMO; memo++)
			st->mapping_memo[memo].kind = 0;
		st->memo_tgid = st->tgid;
		st->memo_start_ns = st->start_ns;
		st->memo_exec_id = st->exec_id;
		st->memo_epoch = st->epochs >> 32;
	}
	/* Tagged with the epoch plus one: a zeroed state (no walk yet) never matches. */
	if (st->row_memo_tag != (st->epochs >> 32) + 1) {
		for (memo = 0; memo < FIRN_ROW_MEMO; memo++)
			st->row_memo[memo].first = FIRN_ROW_MEMO_EMPTY;
		st->row_memo_tag = (st->epochs >> 32) + 1;
	}
	st->row_memo_hits = 0;
	st->len = 0;
	st->cached = 0;
	st->unmapped = 0;
	st->end = FIRN_END_COMPLETE;
	st->bp_known = 1;
	st->exact_pc = 1;
	st->fp_why = 0;
	/* The window is this walk's: another process's stack is never read from it. */
	st->win_len = 0;
	st->win_reads = 0;
	/* Seeded, and per process: equal frames of two processes are two stacks. */
	st->hash = mix(mix(hash_seed ^ 0xcbf29ce484222325ULL,
			   (__u64)key->tgid << 32 | key->exec_id), key->start_ns);
	st->tid = key->tid;
	st->py_state = FIRN_PY_STATE_NONE;
	st->py_walking = 0;
	st->py_skip_native = 0;
	st->py_frame = 0;
	/* Known native from this CPU's last sample (key_of): no lookup. */
	py = st->py_checked == FIRN_PY_NATIVE ? NULL : bpf_map_lookup_elem(&pyprocs, &st->tgid);
	st->py_checked = FIRN_PY_NATIVE;
	if (py && py->start_ns == st->start_ns && py->exec_id == st->exec_id && types_ok(py)) {
		st->py = *py;
		st->py_state = FIRN_PY_STATE_UNLOOKED;
		st->py_hash = mix(st->hash, 0x9e3779b97f4a7c15ULL);
		st->py_checked = FIRN_PY_INTERPRETER;
	}
	st->py_frames = 0;
	st->table_frames = 0;
	st->fp_frames = 0;
	st->stopped = 0;
	if (st->py_state)
		seen_cache_check(st);
	steps = bpf_loop(FIRN_UNWIND_STEPS, unwind_step, NULL, 0);
	if (st->py_frames)
		add(FIRN_CTR_PY_FRAMES, st->py_frames);
	if (st->table_frames)
		add(FIRN_CTR_TABLE_FRAMES, st->table_frames);
	if (st->fp_frames)
		add(FIRN_CTR_FP_FRAMES, st->fp_frames);
	if (st->win_reads)
		add(FIRN_CTR_STACK_WINDOWS, st->win_reads);
	if (st->row_memo_hits)
		add(FIRN_CTR_ROW_MEMO_HITS, st->row_memo_hits);
	if (steps >= FIRN_UNWIND_STEPS && !st->stopped && st->len < FIRN_MAX_STACK_DEPTH) {
		/* Every step ran and none ended the walk. */
		st->end = FIRN_END_DEPTH;
		bump(FIRN_CTR_LOOP_BUDGET);
	}

	len = st->len;
	if (len == 0) {
		key->user_status = -FIRN_EFAULT;
		return 0;
	}
	if (len < FIRN_MAX_STACK_DEPTH)
		st->stack.frames[len] = 0;
	key->unwind_end = st->end < FIRN_END_MAX ? st->end : FIRN_END_UNSUPPORTED;
	bump(FIRN_CTR_END_BASE + key->unwind_end);
	key->user_stack = st->hash ? st->hash : 1;
	/* Stored by this CPU since the last flip: a set is emptied only after a flip away
	 * from it, which moves set_epoch, so the tag tells the copy is still there. Read
	 * after active_set, which the sampler writes after set_epoch: a sample can see a
	 * flip's epoch with the set before it, never the reverse, and such a tag matches
	 * only samples that straddle the same flip, which end before the drain. */
	tag = (__u64)set_epoch << 1 | (set & 1);
	memo = key->user_stack & (FIRN_STORED_MEMO - 1);
	if (st->stored[memo].hash == key->user_stack && st->stored[memo].tag == tag)
		return st->unmapped == 1;
	/* Chosen after the walk: a map pointer live across bpf_loop splits the verifier's
	 * states by set, and it walks the unwinder once for each. */
	ustacks = set == 0 ? (void *)&ustacks_0 : (void *)&ustacks_1;
	/* Another CPU may have stored the same stack meanwhile (EEXIST): fine. */
	if (!bpf_map_lookup_elem(ustacks, &key->user_stack) &&
	    bpf_map_update_elem(ustacks, &key->user_stack, &st->stack, BPF_NOEXIST) != 0 &&
	    !bpf_map_lookup_elem(ustacks, &key->user_stack)) {
		bump(FIRN_CTR_USER_STACK_FULL);
		key->user_stack = 0;
		key->user_status = -FIRN_ENOMEM;
		return st->unmapped == 1;
	}
	st->stored[memo].hash = key->user_stack;
	st->stored[memo].tag = tag;
	return st->unmapped == 1;
}

#endif
