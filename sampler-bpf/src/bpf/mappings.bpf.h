/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Where a pc of the current process lies, for the unwinder (unwind.bpf.h, which includes
 * this after its walk state): the process's executable mappings (`procmaps`, written by
 * the sampler from /proc/PID/maps), its files' tables (`tables` → a run of `rows`, built
 * by the enricher and checked by the sampler), the mapping that holds a pc and the row
 * that covers it, with the per-walk and per-CPU memos of mappings resolved before.
 */
#ifndef FIRN_MAPPINGS_BPF_H
#define FIRN_MAPPINGS_BPF_H

/* Unwind rows of every table, one run per file. The sampler sizes it before loading
 * (--unwind-rows), hands out runs and copies rows in through a mapped window. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct firn_unwind_row);
} rows SEC(".maps");

/* File → its run in `rows` and its page directory. Not preallocated: a preallocated
 * hash hands a replaced element to the next update at once, so a walk holding it could
 * read one table's run with another's directory; here it is freed after the walks that
 * may hold it, and an idle node's few dozen tables take only their own memory. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct firn_file_key);
	__type(value, struct firn_table);
} tables SEC(".maps");

/* tgid → executable mappings of the process. Not preallocated (2 KiB a process). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct firn_proc_maps);
} procmaps SEC(".maps");

/* What holds a pc of the current process. */
enum firn_mapping_kind {
	MAPPING_FILE_TABLE = 1,    /* a file mapping whose file has a table */
	MAPPING_FILE = 2,          /* a file mapping, no table */
	MAPPING_ANON = 3,          /* anonymous executable memory: JIT code, the vDSO */
	MAPPING_NONE = 4,          /* no executable mapping known to hold it */
	MAPPING_NO_PROCESS = 5,    /* the process's mappings are not in the map (yet) */
};

/* Caches the mapping in st->c_* for the next frames, and in this CPU's memo for the
 * next samples of the process. */
static __always_inline __u32 remember_mapping(struct firn_unwind_state *st, __u32 kind)
{
	struct firn_mapping_memo *m = &st->mapping_memo[st->memo_next++ & (FIRN_MAPPING_MEMO - 1)];

	m->start = st->c_start;
	m->end = st->c_end;
	m->offset = st->c_offset;
	m->first = st->c_first;
	m->count = st->c_count;
	m->base = st->c_base;
	m->pages = st->c_pages;
	m->shift = st->c_shift;
	m->kind = kind;
	st->cached = kind;
	return kind;
}

/* One step of a binary search for the last entry at or below a key, its bounds moved by
 * masks, not branches: `below` is all ones when entry `mid` is at or below the key. A
 * branch per step doubles the paths the verifier walks, and which way a step goes
 * depends on the pc (a predictor cold again 10 ms after the last sample misses half).
 * A macro: a function taking the bounds by pointer cost the verifier 3× the instructions. */
#define NARROW(lo, hi, mid, below)                                                       \
	do {                                                                             \
		__u32 narrow_below_ = (__u32)(below); /* evaluated once */               \
		(lo) ^= ((lo) ^ ((mid) + 1)) & narrow_below_;                            \
		(hi) ^= ((hi) ^ (mid)) & ~narrow_below_;                                 \
	} while (0)

/* Finds the executable mapping holding `pc` and caches it with its table. */
static __always_inline __u32 find_mapping(struct firn_unwind_state *st, __u64 pc)
{
	struct firn_proc_maps *pm;
	struct firn_file_key file;
	struct firn_mapping_memo *m;
	struct firn_table *t;
	__u32 lo = 0, hi, mid, idx, j, hit = FIRN_MAPPING_MEMO;

	if (st->cached && pc >= st->c_start && pc < st->c_end)
		return st->cached;
	for (j = 0; j < FIRN_MAPPING_MEMO; j++)
		if (st->mapping_memo[j].kind && pc >= st->mapping_memo[j].start &&
		    pc < st->mapping_memo[j].end)
			hit = j;
	if (hit < FIRN_MAPPING_MEMO) {
		m = &st->mapping_memo[hit];
		st->c_start = m->start;
		st->c_end = m->end;
		st->c_offset = m->offset;
		st->c_first = m->first;
		st->c_count = m->count;
		st->c_base = m->base;
		st->c_pages = m->pages;
		st->c_shift = m->shift;
		st->cached = m->kind;
		return st->cached;
	}
	pm = bpf_map_lookup_elem(&procmaps, &st->tgid);
	if (!pm || pm->start_ns != st->start_ns || pm->exec_id != st->exec_id)
		return MAPPING_NO_PROCESS;
	hi = pm->count;
	if (hi >= FIRN_MAX_MAPPINGS) {
		hi = FIRN_MAX_MAPPINGS;
		st->unmapped = 2;
	}
	/* Last mapping starting at or below pc; 2^7 > FIRN_MAX_MAPPINGS. With a branch per
	 * step, kernels whose pruning keeps the paths apart went past the verifier's 1 M
	 * instructions. */
	for (j = 0; j < 7 && lo < hi; j++) {
		mid = (lo + hi) / 2;
		if (mid >= FIRN_MAX_MAPPINGS)
			return MAPPING_NONE;
		/* Both lie in user space (below 2^56): the difference's top bit is the
		 * comparison. */
		NARROW(lo, hi, mid, ((pc - pm->m[mid].start) >> 63) - 1);
	}
	if (lo == 0)
		return MAPPING_NONE;
	idx = lo - 1;
	if (idx >= FIRN_MAX_MAPPINGS || pc - pm->m[idx].start >= (__u64)pm->m[idx].pages << 12)
		return MAPPING_NONE;
	st->c_start = pm->m[idx].start;
	st->c_end = pm->m[idx].start + ((__u64)pm->m[idx].pages << 12);
	st->c_offset = (__u64)pm->m[idx].offset_pages << 12;
	if (pm->m[idx].inode == 0)
		return remember_mapping(st, MAPPING_ANON);
	file.inode = pm->m[idx].inode;
	file.dev = pm->m[idx].dev;
	file.reserved = 0;
	t = bpf_map_lookup_elem(&tables, &file);
	if (!t)
		return remember_mapping(st, MAPPING_FILE);
	st->c_first = t->first;
	st->c_count = t->count;
	st->c_base = t->base;
	st->c_pages = t->pages;
	st->c_shift = t->shift;
	return remember_mapping(st, MAPPING_FILE_TABLE);
}

/* The memo entry for offset `off` of the table whose run starts at `first`. */
static __always_inline __u32 row_memo_slot(__u32 first, __u32 off)
{
	return ((off ^ first * 0x9e3779b1U) * 0x9e3779b1U) >> 26;
}
_Static_assert(FIRN_ROW_MEMO == 64, "row_memo_slot keeps 6 bits");

/* The row for `pc`, which lies in the cached mapping, or why there is none. An offset
 * this CPU looked up lately in the same table is answered from its memo of rows (what
 * the search below gave then, under the same proc_epoch). Else the search starts from
 * the rows of the offset's page (the directory after the table's rows, built by the
 * sampler: the last row at or below the page's start, the first at or past its end), so
 * a frame reads a few rows of one or two cache lines, not 15-20 scattered over the
 * table. It keeps the last row at or below the offset as it goes (no second lookup),
 * and moves its bounds by masks (NARROW). */
static __always_inline __u32 find_row(struct firn_unwind_state *st, __u64 pc, struct firn_unwind_row *out)
{
	__u64 *r, found = 0, below, page;
	__u32 lo, hi, mid, idx, first = st->c_first, j, slot;
	__u64 off = pc - st->c_start + st->c_offset;
	struct firn_row_memo *e;

	if (off > 0xffffffffULL || off < st->c_base || !st->c_pages)
		return FIRN_END_NOT_IN_TABLE;
	slot = row_memo_slot(first, (__u32)off) & (FIRN_ROW_MEMO - 1);
	e = &st->row_memo[slot];
	if (e->first == first && e->off == (__u32)off) {
		st->row_memo_hits++;
		found = e->row;
		goto done;
	}
	page = (off - st->c_base) >> (st->c_shift & 63);
	if (page >= st->c_pages)
		page = st->c_pages - 1;
	idx = first + st->c_count + (__u32)page;
	r = bpf_map_lookup_elem(&rows, &idx);
	if (!r)
		return FIRN_END_NOT_IN_TABLE;
	lo = (__u32)*r;
	hi = *r >> 32;
	/* Last row at or below off; the sampler keeps count < 2^24. */
	if (hi > st->c_count)
		hi = st->c_count;
	for (j = 0; j < 24 && lo < hi; j++) {
		mid = lo + (hi - lo) / 2;
		idx = first + mid;
		r = bpf_map_lookup_elem(&rows, &idx);
		if (!r)
			return FIRN_END_NOT_IN_TABLE;
		/* All ones when the row's pc (its low 32 bits) is at or below off. */
		below = -(((*r & 0xffffffffULL) - off - 1) >> 63);
		found ^= (found ^ *r) & below;
		NARROW(lo, hi, mid, below);
	}
	/* Found again rather than kept across the search: a pointer live across its loop
	 * multiplies the states the verifier walks it with. */
	e = &st->row_memo[slot & (FIRN_ROW_MEMO - 1)];
	e->first = first;
	e->off = (__u32)off;
	e->row = found;
done:
	__builtin_memcpy(out, &found, sizeof(found));
	/* No row at or below off leaves found 0, whose kind is FIRN_CFA_NONE. */
	if ((out->kinds & 0xf) == FIRN_CFA_NONE)
		return FIRN_END_NOT_IN_TABLE;
	return 0;
}

#endif
