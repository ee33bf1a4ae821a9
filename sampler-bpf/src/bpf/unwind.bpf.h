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

#include "walk_state.bpf.h"

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
	__u32 cpu;
	long r;

	(void)i;
	(void)data;
	st = walk_state(&cpu);
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
	__u32 cpu, len, memo;
	void *ustacks;
	long steps;
	__u64 tag;

	st = walk_state(&cpu);
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
		/* In the kernel: the user registers saved at entry. Loads from the BTF-typed
		 * pointer, not three bpf_probe_read_kernel calls (key_of's reason). */
		regs = (struct pt_regs *)bpf_task_pt_regs(task);
		st->pc = regs->ip;
		st->sp = regs->sp;
		st->bp = regs->bp;
	}
	if (st->pc == 0 || st->pc >= USER_SPACE_END) {
		key->user_status = -FIRN_EFAULT;
		return 0;
	}
	st->tgid = key->tgid;
	st->start_ns = key->start_ns;
	st->exec_id = key->exec_id;
	/* The memo of mappings holds for one process under one proc_epoch (key_of read it). */
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
