/* SPDX-License-Identifier: GPL-2.0 */
/*
 * CPython frames, for the unwinder of unwind.bpf.h (included there, before its step).
 * When a native frame's pc lies in a process's eval loop (`pyprocs`, written by the
 * sampler from a record the enricher built and the sampler checked), the frames that
 * eval call runs are emitted in its place: tagged entries (FIRN_PY_TAG) naming a code
 * object by a seeded hash and the instruction by its index. Nothing read here becomes a
 * frame but that hash and index. A code object's qualname, file name and line table are
 * copied into `pycode` (drained by the sampler each round, forwarded as opaque bytes)
 * the first time it is met, and only from objects whose type word is the interpreter's
 * own `code`, `str` or `bytes` type, whose names the walk read first (DESIGN rule 9).
 */
#ifndef FIRN_PYTHON_BPF_H
#define FIRN_PYTHON_BPF_H

/* tgid → the process's interpreter. Not preallocated. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct firn_py_proc);
} pyprocs SEC(".maps");

/* tid → its thread state, found once in the interpreter's thread list, checked again
 * at every use. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32);
	__type(value, __u64);
} pythreads SEC(".maps");

/* Code objects met, by code id: each is copied once. The sampler empties the map when
 * a subscriber arrives, so a new subscriber gets every code object again. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u8);
} pyseen SEC(".maps");

/* Code ids → what the enricher needs to name them, until the sampler's next drain. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FIRN_PY_CODE_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, struct firn_py_code);
} pycode SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct firn_py_code);
} pyscratch SEC(".maps");

/* Moved on by the sampler each time it empties pyseen: the per-CPU caches of seen code
 * ids are then dropped too. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} pyepoch SEC(".maps");

/* Drops this CPU's cache of seen code ids if pyseen was emptied since it was filled. */
static __always_inline void seen_cache_check(struct firn_unwind_state *st)
{
	__u32 zero = 0;
	__u64 *epoch = bpf_map_lookup_elem(&pyepoch, &zero);
	int i;

	if (!epoch || *epoch == st->seen_epoch)
		return;
	for (i = 0; i < FIRN_PY_SEEN_CACHE; i++)
		st->seen_ids[i] = 0;
	st->seen_epoch = *epoch;
}

static __always_inline int in_eval(const struct firn_py_proc *p, __u64 pc)
{
	return (pc >= p->eval_start && pc < p->eval_end) ||
	       (pc >= p->cold_start && pc < p->cold_end);
}

/* A word of a buffer read from the process at a record's offset (the pinned layouts'
 * word fields are 8-byte aligned). */
static __always_inline __u64 word_of(const __u8 *buf, __u32 off, __u32 size)
{
	if (off > size - 8)
		return 0;
	return *(const __u64 *)(buf + off);
}

/* A 4-byte field (co_firstlineno, 4-byte aligned). */
static __always_inline __u32 u32_of(const __u8 *buf, __u32 off, __u32 size)
{
	if (off > size - 4)
		return 0;
	return *(const __u32 *)(buf + off);
}

/* Of every standard CPython 3.10–3.13 build (the record's pinned layouts have tp_name
 * at 24 with it): where PyTypeObject keeps tp_flags, and its heap-type flag. */
#define FIRN_PY_TP_FLAGS 168
#define FIRN_PY_TPFLAGS_HEAPTYPE (1ULL << 9)

/* Whether the type at `type` is a static type named `want` (at most 7 characters and
 * its NUL) whose own type is named "type": 1 yes, 0 no, -1 unreadable (a page not in
 * memory yet: asked again at a later sample). */
static __always_inline int type_named(const struct firn_py_proc *p, __u64 type, __u64 want, __u64 mask)
{
	__u64 name = 0, got = 0, flags = 0, meta = 0, meta_name = 0;

	if (read_user(&name, type + p->type_name) || read_user(&flags, type + FIRN_PY_TP_FLAGS) ||
	    read_user(&meta, type + p->object_type))
		return -1;
	if (!name || name >= USER_SPACE_END || !meta || meta >= USER_SPACE_END)
		return 0;
	if (bpf_probe_read_user(&got, sizeof(got), (const void *)name) ||
	    read_user(&meta_name, meta + p->type_name) || !meta_name || meta_name >= USER_SPACE_END)
		return -1;
	if ((got & mask) != want || (flags & FIRN_PY_TPFLAGS_HEAPTYPE))
		return 0;
	got = 0;
	if (bpf_probe_read_user(&got, sizeof(got), (const void *)meta_name))
		return -1;
	/* Little-endian "type\0". */
	return (got & 0xffffffffffULL) == 0x65707974ULL;
}

/* Once per process (the answer is kept in its pyprocs entry): its record's types are
 * CPython's static `code`, `str` and `bytes`. A read that fails is asked again later;
 * only a type that was read and is not one of them is final. */
static __noinline int types_ok(struct firn_py_proc *p)
{
	int c, s, b;

	if (p->types_checked == 1)
		return 1;
	if (p->types_checked == 2)
		return 0;
	/* Little-endian "code\0", "str\0", "bytes\0". */
	c = type_named(p, p->code_type, 0x65646f63ULL, 0xffffffffffULL);
	s = type_named(p, p->str_type, 0x727473ULL, 0xffffffffULL);
	b = type_named(p, p->bytes_type, 0x7365747962ULL, 0xffffffffffffULL);
	if (c == 1 && s == 1 && b == 1) {
		p->types_checked = 1;
		return 1;
	}
	if (c == 0 || s == 0 || b == 0) {
		p->types_checked = 2;
		bump(FIRN_CTR_PY_BAD_TYPES);
	} else {
		bump(FIRN_CTR_PY_READ_FAULT);
	}
	return 0;
}

/* The current thread's state in the interpreter's thread list: its thread_id is the
 * thread's pthread_t, which is its fs base on x86_64 (the same in every pid
 * namespace). 0: none found within FIRN_PY_MAX_THREADS. */
static __noinline __u64 thread_state(struct firn_unwind_state *st, __u32 tid)
{
	struct firn_py_proc *p = &st->py;
	/* A load from the BTF-typed task, not bpf_probe_read_kernel: one helper fewer on
	 * every Python sample (key_of's reason). */
	__u64 fsbase = bpf_get_current_task_btf()->thread.fsbase;
	__u64 ts, id, interp;
	__u64 *cached;
	int i;

	if (!fsbase)
		return 0;
	cached = bpf_map_lookup_elem(&pythreads, &tid);
	if (cached) {
		ts = *cached;
		if (!read_user(&id, ts + p->tstate_thread_id) && id == fsbase)
			return ts;
	}
	/* The main interpreter. The 3.10–3.12 layouts name `interpreters.main`; 3.13's
	 * debug offsets name `interpreters.head` (the newest interpreter, a subinterpreter's
	 * when there is one), which `main` follows. */
	if (read_user(&interp, p->runtime + p->runtime_interpreters + (p->minor >= 13 ? 8 : 0)) ||
	    !interp)
		return 0;
	if (read_user(&ts, interp + p->interp_threads_head))
		return 0;
	for (i = 0; i < FIRN_PY_MAX_THREADS && ts; i++) {
		if (read_user(&id, ts + p->tstate_thread_id))
			return 0;
		if (id == fsbase) {
			bpf_map_update_elem(&pythreads, &tid, &ts, BPF_ANY);
			return ts;
		}
		if (read_user(&ts, ts + p->tstate_next))
			return 0;
	}
	return 0;
}

/* The innermost Python frame of the sampled thread, or 0 (counted). */
static __noinline __u64 current_frame(struct firn_unwind_state *st, __u32 tid)
{
	struct firn_py_proc *p = &st->py;
	__u64 ts, frame = 0;

	ts = thread_state(st, tid);
	if (!ts) {
		bump(FIRN_CTR_PY_NO_THREAD);
		return 0;
	}
	if (read_user(&frame, ts + p->tstate_frame))
		goto fault;
	if (p->cframe_frame != FIRN_PY_NONE && frame &&
	    read_user(&frame, frame + p->cframe_frame))
		goto fault;
	if (!frame)
		bump(FIRN_CTR_PY_NO_THREAD);
	return frame;
fault:
	bump(FIRN_CTR_PY_READ_FAULT);
	return 0;
}

/* Copies a str's characters (compact ASCII only) into dst; returns the length taken,
 * sets FIRN_PY_* flags for truncation and other kinds, and *fault when a read failed
 * (then nothing of the code object is kept, and it is copied again when met again). */
static __always_inline __u32 copy_str(const struct firn_py_proc *p, __u64 obj, char *dst,
				      __u32 cap, __u8 *flags, __u8 trunc_flag, int *fault)
{
	__u64 type = 0, len = 0;
	__u32 state = 0, n;

	if (!obj) {
		*flags |= FIRN_PY_NOT_STR;
		return 0;
	}
	/* A failed read may be a page not in memory yet (3.11 on keep frozen modules' strs
	 * in the interpreter's data) as well as no object at all: asked again later. */
	if (read_user(&type, obj + p->object_type)) {
		*fault = 1;
		return 0;
	}
	if (type != p->str_type) {
		*flags |= FIRN_PY_NOT_STR;
		return 0;
	}
	if (read_user(&len, obj + p->str_length) ||
	    bpf_probe_read_user(&state, sizeof(state), (const void *)(obj + p->str_state))) {
		*fault = 1;
		return 0;
	}
	/* state: interned (2 bits), kind (3), compact, ascii. */
	if ((state & 0x60) != 0x60) {
		*flags |= FIRN_PY_NOT_ASCII;
		return 0;
	}
	n = len > cap ? cap : (__u32)len;
	if (len > cap)
		*flags |= trunc_flag;
	if (n > cap)
		return 0;
	if (bpf_probe_read_user(dst, n, (const void *)(obj + p->str_ascii_data))) {
		*fault = 1;
		return 0;
	}
	return n;
}

/* Whether the word at `code + off` still reads as st->code_buf has it. */
static __always_inline int unchanged(struct firn_unwind_state *st, __u64 code, __u32 off)
{
	__u64 now = 0;

	return !read_user(&now, code + off) && now == word_of(st->code_buf, off, FIRN_PY_CODE_BUF);
}

/* Copies what names code object `code` (its fixed part read into st->code_buf) into
 * pycode under `id`, once. */
static __noinline void capture_code(struct firn_unwind_state *st, __u64 code, __u64 id)
{
	struct firn_py_proc *p = &st->py;
	struct firn_py_code *c;
	__u64 table, type = 0, size = 0;
	__u32 zero = 0, n, slot = id & (FIRN_PY_SEEN_CACHE - 1);
	__u8 yes = 1;
	int fault = 0;

	if (id && st->seen_ids[slot] == id)
		return;
	if (bpf_map_lookup_elem(&pyseen, &id)) {
		st->seen_ids[slot] = id;
		return;
	}
	c = bpf_map_lookup_elem(&pyscratch, &zero);
	if (!c)
		return;
	c->id = id;
	c->minor = p->minor;
	c->flags = 0;
	c->reserved = 0;
	c->first_line = u32_of(st->code_buf, p->code_firstlineno, FIRN_PY_CODE_BUF);
	c->name_len = copy_str(p, word_of(st->code_buf, p->code_name, FIRN_PY_CODE_BUF),
			       c->name, FIRN_PY_NAME_BYTES, &c->flags, FIRN_PY_NAME_CUT, &fault);
	c->file_len = copy_str(p, word_of(st->code_buf, p->code_filename, FIRN_PY_CODE_BUF),
			       c->file, FIRN_PY_FILE_BYTES, &c->flags, FIRN_PY_FILE_CUT, &fault);
	c->table_len = 0;
	table = word_of(st->code_buf, p->code_linetable, FIRN_PY_CODE_BUF);
	if (!table) {
		c->flags |= FIRN_PY_NOT_BYTES;
	} else if (read_user(&type, table + p->object_type) ||
		   read_user(&size, table + p->bytes_size)) {
		fault = 1;
	} else if (type != p->bytes_type) {
		c->flags |= FIRN_PY_NOT_BYTES;
	} else {
		n = size > FIRN_PY_TABLE_BYTES ? FIRN_PY_TABLE_BYTES : (__u32)size;
		if (size > FIRN_PY_TABLE_BYTES)
			c->flags |= FIRN_PY_TABLE_CUT;
		if (n <= FIRN_PY_TABLE_BYTES &&
		    bpf_probe_read_user(c->table, n, (const void *)(table + p->bytes_data)))
			fault = 1;
		else
			c->table_len = n;
	}
	/* Another thread of the process may have freed the code object meanwhile and the
	 * memory of its names held other objects by the time they were copied: what was
	 * copied counts only if the object still points at the same names. */
	if (!fault && !(unchanged(st, code, p->object_type) && unchanged(st, code, p->code_name) &&
			unchanged(st, code, p->code_filename) &&
			unchanged(st, code, p->code_linetable)))
		fault = 1;
	if (fault) {
		/* Part of it is not in memory now (paged out, not yet touched) or it changed:
		 * its frames stay unnamed until it is met again and read whole. */
		bump(FIRN_CTR_PY_READ_FAULT);
		return;
	}
	if (bpf_map_update_elem(&pycode, &id, c, BPF_NOEXIST) != 0 &&
	    !bpf_map_lookup_elem(&pycode, &id)) {
		/* Full until the sampler's next drain: met again later, copied then. */
		bump(FIRN_CTR_PY_CODE_FULL);
		return;
	}
	bump(FIRN_CTR_PY_CODE_COPIED);
	bpf_map_update_elem(&pyseen, &id, &yes, BPF_ANY);
	st->seen_ids[slot] = id;
}

/* Ends the Python frames of one eval call. The native step that follows unwinds the
 * eval frame without recording it when Python frames stand in for it, and keeps it
 * (without walking it again) when none could be emitted. */
static __always_inline long end_eval_call(struct firn_unwind_state *st)
{
	st->py_walking = 0;
	st->py_skip_native = st->py_call_frames ? FIRN_PY_AFTER_UNRECORDED : FIRN_PY_AFTER_RECORDED;
	return 0;
}

/* One frame of the Python chain (a bpf_loop step while st->py_walking). */
static __noinline long python_step(struct firn_unwind_state *st)
{
	struct firn_py_proc *p = &st->py;
	__u64 frame = st->py_frame, code, instr, off, id, entry;
	__u32 len = st->len, span = p->frame_span, cspan = p->code_span;
	__u8 b;

	if (!frame)
		return end_eval_call(st);
	if (len >= FIRN_MAX_STACK_DEPTH) {
		st->end = FIRN_END_DEPTH;
		return 1;
	}
	if (span > FIRN_PY_FRAME_BUF || cspan > FIRN_PY_CODE_BUF || span < 8 || cspan < 8)
		return end_eval_call(st);
	if (bpf_probe_read_user(st->frame_buf, span, (const void *)frame))
		goto fault;
	st->py_frame = word_of(st->frame_buf, p->frame_previous, FIRN_PY_FRAME_BUF);
	b = p->boundary_offset < FIRN_PY_FRAME_BUF ? st->frame_buf[p->boundary_offset & (FIRN_PY_FRAME_BUF - 1)] : 0;
	if (p->boundary == FIRN_PY_BOUNDARY_OWNER && b == p->cstack)
		/* The eval call's shim frame: its Python frames end here. */
		return end_eval_call(st);
	code = word_of(st->frame_buf, p->frame_code, FIRN_PY_FRAME_BUF);
	if (!code || code >= USER_SPACE_END ||
	    bpf_probe_read_user(st->code_buf, cspan, (const void *)code))
		goto fault;
	if (word_of(st->code_buf, p->object_type, FIRN_PY_CODE_BUF) != p->code_type) {
		/* Not a code object: the walk stops rather than guess. */
		bump(FIRN_CTR_PY_NOT_CODE);
		st->py_frame = 0;
		return end_eval_call(st);
	}
	if (p->position == FIRN_PY_POSITION_LASTI) {
		__s32 lasti = (__s32)word_of(st->frame_buf, p->frame_instr, FIRN_PY_FRAME_BUF);

		off = lasti > 0 ? (__u64)lasti : 0;
	} else {
		instr = word_of(st->frame_buf, p->frame_instr, FIRN_PY_FRAME_BUF);
		off = instr > code + p->code_adaptive ? (instr - code - p->code_adaptive) / 2 : 0;
	}
	if (off > FIRN_PY_INDEX_MASK)
		off = FIRN_PY_INDEX_MASK;
	/* The code object by a seeded hash of where it is, in which process, and two of
	 * its fields, so that a code object freed and another made at its address is
	 * another id. */
	id = mix(mix(mix(st->py_hash, code),
		     word_of(st->code_buf, p->code_name, FIRN_PY_CODE_BUF)),
		 word_of(st->code_buf, p->code_filename, FIRN_PY_CODE_BUF)) & FIRN_PY_ID_MASK;
	entry = FIRN_PY_TAG | id << FIRN_PY_INDEX_BITS | off;
	if (len < FIRN_MAX_STACK_DEPTH)
		st->stack.frames[len] = entry;
	st->len = len + 1;
	st->hash = mix(st->hash, entry);
	st->py_frames++;
	st->py_call_frames++;
	capture_code(st, code, id);
	if (p->boundary == FIRN_PY_BOUNDARY_ONE_FRAME ||
	    (p->boundary == FIRN_PY_BOUNDARY_IS_ENTRY && b))
		return end_eval_call(st);
	return 0;
fault:
	bump(FIRN_CTR_PY_READ_FAULT);
	st->py_frame = 0;
	return end_eval_call(st);
}

/* Whether the eval frame at st->pc has Python frames to emit first; sets the walk. */
static __always_inline int python_enter(struct firn_unwind_state *st, __u32 tid)
{
	if (st->py_state == FIRN_PY_STATE_UNLOOKED) {
		st->py_frame = current_frame(st, tid);
		st->py_state = FIRN_PY_STATE_LOOKED;
	}
	if (!st->py_frame)
		return 0;
	st->py_walking = 1;
	st->py_call_frames = 0;
	return 1;
}

#endif
