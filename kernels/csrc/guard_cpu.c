/* kvguard's compiled CPU kernels: the guard's hot path in one pass over each step's reads and
 * writes, bit-identical to the torch reference (kernels/guard_ref.py, the specification; read it
 * first: every rule here is a line there). tests/test_guard_kernels.py drives both through one
 * corruption matrix and compares verdicts and ledger state.
 *
 * A CPython extension with no torch headers: tensors arrive as raw addresses (data_ptr) of
 * contiguous host memory, sizes as integers. Nothing here allocates per step except small
 * scratch tables sized by the step's writes.
 */
#include <stdlib.h>
#include <string.h>

#include "kv_hash.h"

enum { FREE = 0, OWNED = 1, SHARED = 2, QUARANTINED = 3, ALLOCATED = 4 };
enum { EV_CLAIM = 1, EV_SHARE = 3, EV_FREE = 4, EV_ALLOC = 6, EV_REBIND = 8 };
enum {
    TABLE_MISMATCH = 1 << 0, MISPLACED_SLOT = 1 << 1, DOUBLE_ALLOCATION = 1 << 2,
    WRONG_OWNER = 1 << 3, WRITE_TO_SHARED = 1 << 4, OVERWRITE = 1 << 5, READ_UNWRITTEN = 1 << 6,
    PREFIX_MISMATCH = 1 << 7, CHECKSUM_MISMATCH = 1 << 8, QUARANTINED_PAGE = 1 << 9,
    ROW_MISMATCH = 1 << 12
};
#define HISTORY 4
#define NO_ROW 0xFFFFFLL
#define EPOCH_STEP_SHIFT 24

static inline u64 chain_term(i64 tok, i64 pos) { return splitmix64((u64)tok * GOLDEN + (u64)pos); }

/* ---- the ledger and the rows, as the Python side lays them out (kernels/guard_state.py) ---- */
typedef struct {
    uint8_t *state, *prior;
    int16_t *fill;
    int32_t *owner, *owner_gen, *lpage;
    i64 *epoch, *chain, *digest, *history;
    i64 num_pages;
} Pages;
typedef struct {
    int32_t *gen, *n_pages, *chain_len;
    i64 *agg, *chain_tail;
} Rows;

/* ---- KV buffers: every stored byte, as little-endian 32-bit words per slot ---- */
typedef struct {
    const uint8_t *base;
    i64 slot_stride; /* bytes between slots (within a page, for page-major buffers) */
    i64 page_stride; /* bytes between pages; 0: slot-major */
    i64 slots_per_page;
    i64 words;
} Buf;
typedef struct {
    const Buf *bufs;
    int nbuf;
    /* the odd 64-bit word constants C[b, j], split in halves: w * C = w * lo + ((w * hi) << 32)
     * (mod 2**64), so the sum vectorizes as a widening 32-bit multiply plus a 32-bit one */
    const uint32_t *lo, *hi; /* [nbuf, wmax] */
    i64 wmax;
} Kv;

static inline __attribute__((always_inline)) const uint32_t *slot_words(const Buf *b, i64 slot) {
    if (b->page_stride == 0) return (const uint32_t *)(b->base + slot * b->slot_stride);
    i64 p = slot / b->slots_per_page, o = slot % b->slots_per_page;
    return (const uint32_t *)(b->base + p * b->page_stride + o * b->slot_stride);
}


/* Hashing many tokens: one buffer at a time over all of them (the access pattern of a gather:
 * independent rows of one array), asking for the rows PREFETCH_AHEAD tokens ahead, then the
 * position mix. `inner` is scratch of n words. */
#define PREFETCH_AHEAD 12
CLONES static void token_digests_into(const Kv *kv, const i64 *slots, const i64 *pos, i64 n,
                                      u64 *inner, i64 *out) {
    memset(inner, 0, sizeof(u64) * (size_t)n);
    for (int b = 0; b < kv->nbuf; b++) {
        const Buf *bf = &kv->bufs[b];
        const uint32_t *lo = kv->lo + b * kv->wmax, *hi = kv->hi + b * kv->wmax;
        const i64 bytes = bf->words * 4;
        for (i64 t = 0; t < n; t++) {
            if (t + PREFETCH_AHEAD < n) {
                const char *row = (const char *)slot_words(bf, slots[t + PREFETCH_AHEAD]);
                for (i64 off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
            }
            inner[t] += row_inner(slot_words(bf, slots[t]), lo, hi, bf->words);
        }
    }
    for (i64 t = 0; t < n; t++) out[t] = (i64)fmix64(inner[t] ^ splitmix64((u64)pos[t] + POS_SEED));
}

/* Digests of whole pages (their sealed tokens, at the pages' own logical positions): the pages'
 * tokens flattened, hashed as above, summed per page. Returns -1 when out of memory. */
static int page_digests(const Kv *kv, const Pages *P, const i64 *pages, i64 n, i64 ps, u64 *out,
                        i64 *hashed) {
    i64 total = 0;
    for (i64 k = 0; k < n; k++) total += P->fill[pages[k]];
    *hashed += total;
    i64 *slots = (i64 *)malloc(sizeof(i64) * (size_t)(3 * total + 1));
    u64 *inner = (u64 *)malloc(sizeof(u64) * (size_t)(total + 1));
    if (!slots || !inner) {
        free(slots);
        free(inner);
        return -1;
    }
    i64 *pos = slots + total, *dig = slots + 2 * total, t = 0;
    for (i64 k = 0; k < n; k++) {
        const i64 pg = pages[k], lp = P->lpage[pg] < 0 ? 0 : P->lpage[pg];
        for (i64 o = 0; o < P->fill[pg]; o++, t++) {
            slots[t] = pg * ps + o;
            pos[t] = lp * ps + o;
        }
    }
    token_digests_into(kv, slots, pos, total, inner, dig);
    t = 0;
    for (i64 k = 0; k < n; k++) {
        u64 sum = 0;
        for (i64 o = 0; o < P->fill[pages[k]]; o++, t++) sum += (u64)dig[t];
        out[k] = sum;
    }
    free(slots);
    free(inner);
    return 0;
}

static void push_history(Pages *P, i64 page, int event, i64 step, i64 row) {
    i64 packed = (step << 24) | ((i64)event << 20) | (row & NO_ROW);
    i64 *h = P->history + page * HISTORY;
    if (h[0] == packed) return;
    memmove(h + 1, h, (HISTORY - 1) * sizeof(i64));
    h[0] = packed;
}

/* ---- a small open-addressing map page -> value, sized by the step (claims, call dedup) ---- */
typedef struct {
    i64 *keys, *vals;
    i64 cap;
} Map;
static int map_init(Map *m, i64 n) {
    i64 cap = 16;
    while (cap < 2 * n + 2) cap <<= 1;
    m->cap = cap;
    m->keys = (i64 *)malloc(sizeof(i64) * cap);
    m->vals = (i64 *)malloc(sizeof(i64) * cap);
    if (!m->keys || !m->vals) return -1;
    for (i64 i = 0; i < cap; i++) m->keys[i] = -1;
    return 0;
}
static void map_free(Map *m) { free(m->keys); free(m->vals); }
static i64 *map_slot(Map *m, i64 key, int *found) {
    u64 h = fmix64((u64)key) & (u64)(m->cap - 1);
    while (m->keys[h] != -1 && m->keys[h] != key) h = (h + 1) & (u64)(m->cap - 1);
    *found = m->keys[h] == key;
    m->keys[h] = key;
    return &m->vals[h];
}

/* ---- the ledger, rows and buffers as their integer arguments lay them out (ints(): kv_hash.h) ---- */

static void load_pages(Pages *P, const i64 *a) {
    P->state = PTR(uint8_t *, a[0]);
    P->prior = PTR(uint8_t *, a[1]);
    P->fill = PTR(int16_t *, a[2]);
    P->owner = PTR(int32_t *, a[3]);
    P->owner_gen = PTR(int32_t *, a[4]);
    P->lpage = PTR(int32_t *, a[5]);
    P->epoch = PTR(i64 *, a[6]);
    P->chain = PTR(i64 *, a[7]);
    P->digest = PTR(i64 *, a[8]);
    P->history = PTR(i64 *, a[9]);
    P->num_pages = a[10];
}
static void load_rows(Rows *R, const i64 *a) {
    R->gen = PTR(int32_t *, a[0]);
    R->n_pages = PTR(int32_t *, a[1]);
    R->agg = PTR(i64 *, a[2]);
    R->chain_len = PTR(int32_t *, a[3]);
    R->chain_tail = PTR(i64 *, a[4]);
}
static void load_kv(Kv *kv, const i64 *a) {
    kv->bufs = PTR(const Buf *, a[0]);
    kv->nbuf = (int)a[1];
    kv->lo = PTR(const uint32_t *, a[2]);
    kv->hi = PTR(const uint32_t *, a[3]);
    kv->wmax = a[4];
}

/* ctx: int64 array [pages(11), rows(5), kv(5)], built once per pool by guard_cpu.py */
#define CTX_PAGES 0
#define CTX_ROWS 11
#define CTX_KV 16
#define CTX_NUM_ROWS 21

/* A step whose indices point outside the pool or the table (an engine bug far enough gone, or a
 * corrupted tensor) is refused before anything is read: the caller aborts the batch. */
static int check_ranges(const i64 *ctx, i64 B, const i64 *rows, const i64 *L, i64 N,
                        const i64 *wslots, const i64 *wbatch, const i64 *wpos,
                        const int32_t *pt, i64 pt_stride, i64 pt_width, i64 ps) {
    const i64 num_rows = ctx[CTX_NUM_ROWS], num_slots = ctx[CTX_PAGES + 10] * ps;
    for (i64 b = 0; b < B; b++) {
        if (rows[b] < 0 || rows[b] >= num_rows || L[b] < 0 || L[b] > pt_width) {
            PyErr_Format(PyExc_ValueError, "kvguard: request %lld: row %lld or prefix %lld out of range",
                         (long long)b, (long long)rows[b], (long long)L[b]);
            return -1;
        }
        const int32_t *row = pt + rows[b] * pt_stride;
        for (i64 p = 0; p < L[b]; p++)
            if (row[p] < 0 || row[p] >= num_slots) {
                PyErr_Format(PyExc_ValueError, "kvguard: row %lld position %lld names slot %d, outside the pool",
                             (long long)rows[b], (long long)p, row[p]);
                return -1;
            }
    }
    for (i64 j = 0; j < N; j++) {
        const i64 b = wbatch ? wbatch[j] : j;
        if (b < 0 || b >= B || (j && wbatch && b < wbatch[j - 1]) || wslots[j] < 0 ||
            wslots[j] >= num_slots || wpos[j] < 0) {
            PyErr_Format(PyExc_ValueError, "kvguard: write %lld (request %lld, slot %lld, position %lld) out of range",
                         (long long)j, (long long)b, (long long)wslots[j], (long long)wpos[j]);
            return -1;
        }
    }
    return 0;
}

/* ---- check_step: the verdict of one forward (pure: ledger and rows are only read) ----
 * args: ctx, step, B, rows, prefix_lens_host, N, write_slots, write_batch (0: one write per
 * request, in order), write_pos, write_tokens, page_table, pt_stride, pt_width, seeds (0: none),
 * prefix_tokens (0: none), page_size, checksums, verify_all, window_start, window_pages,
 * sweep_start, sweep_pages, pad_slot, out (int64 array of output addresses, see guard_cpu.py).
 * Returns (any request flagged, any page tainted, any page to reclaim, tokens hashed). */
static PyObject *check_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[24];
    if (ints(args, nargs, 24, a)) return NULL;
    const i64 *ctx = PTR(const i64 *, a[0]);
    Pages P; Rows R; Kv kv;
    load_pages(&P, ctx + CTX_PAGES);
    load_rows(&R, ctx + CTX_ROWS);
    load_kv(&kv, ctx + CTX_KV);
    const i64 B = a[2]; /* a[1], the step, only matters to apply_step's epochs */
    const i64 *rows = PTR(const i64 *, a[3]), *L = PTR(const i64 *, a[4]);
    const i64 N = a[5];
    i64 *wslots = PTR(i64 *, a[6]);
    const i64 *wbatch = PTR(const i64 *, a[7]), *wpos = PTR(const i64 *, a[8]);
    const i64 *wtok = PTR(const i64 *, a[9]);
    const int32_t *pt = PTR(const int32_t *, a[10]);
    const i64 pt_stride = a[11], pt_width = a[12];
    const i64 *seeds = PTR(const i64 *, a[13]), *ptok = PTR(const i64 *, a[14]);
    const i64 ps = a[15];
    const int checksums = (int)a[16], verify_all = (int)a[17];
    const i64 window_start = a[18], window_pages = a[19], sweep_start = a[20], sweep_pages = a[21];
    const i64 pad = a[22];
    const i64 *out = PTR(const i64 *, a[23]);
    i64 *kinds = PTR(i64 *, out[0]);
    uint8_t *taint = PTR(uint8_t *, out[1]), *reclaim = PTR(uint8_t *, out[2]);
    i64 *targets = PTR(i64 *, out[3]);
    uint8_t *write_ok = PTR(uint8_t *, out[4]), *claim_ok = PTR(uint8_t *, out[5]);
    i64 *write_chain = PTR(i64 *, out[6]);
    int32_t *o_npages = PTR(int32_t *, out[7]), *o_clen = PTR(int32_t *, out[9]);
    i64 *o_agg = PTR(i64 *, out[8]), *o_ctail = PTR(i64 *, out[10]);
    i64 *marks = PTR(i64 *, out[11]); /* [0]: count (cap + 1: overflowed), then page indices */
    const i64 marks_cap = out[12];
    i64 *scratch = PTR(i64 *, out[13]); /* >= 2 * T + B + 1 entries (guard_cpu.py sizes it) */
    if (check_ranges(ctx, B, rows, L, N, wslots, wbatch, wpos, pt, pt_stride, pt_width, ps)) return NULL;

    /* clear what the previous check of this workspace set */
    if (marks[0] > marks_cap) {
        memset(taint, 0, (size_t)P.num_pages);
        memset(reclaim, 0, (size_t)P.num_pages);
    } else {
        for (i64 m = 0; m < marks[0]; m++) taint[marks[1 + m]] = reclaim[marks[1 + m]] = 0;
    }
    marks[0] = 0;
#define MARK(arr, pg)                                                              \
    do {                                                                           \
        if (!taint[pg] && !reclaim[pg] && marks[0] <= marks_cap) {                 \
            if (marks[0] < marks_cap) marks[1 + marks[0]] = (pg);                  \
            marks[0]++;                                                            \
        }                                                                          \
        arr[pg] = 1;                                                               \
    } while (0)

    i64 T = 0;
    for (i64 b = 0; b < B; b++) T += (L[b] + ps - 1) / ps;
    i64 hashed = 0;
    /* entry index of each request's first read page, each entry's page, and whether it is a
     * freed page validly held (for the passes after all content taint is known) */
    i64 *estart = scratch, *epage = scratch + B + 1, *efree = scratch + B + 1 + T;
    /* entries whose pages are hashed this step: entry, request, read-of-quarantined flag */
    i64 nh = 0, *hlist = (i64 *)malloc(sizeof(i64) * (size_t)(2 * T + 1));
    uint8_t *hq = (uint8_t *)malloc((size_t)T + 1);
    if (!hlist || !hq) {
        free(hlist);
        free(hq);
        return PyErr_NoMemory();
    }
    i64 *hb = hlist + T;

    /* ---- pass 1: reads, adoption, checksums of pages read ---- */
    i64 e = 0;
    for (i64 b = 0; b < B; b++) {
        const i64 r = rows[b], Lb = L[b], np = (Lb + ps - 1) / ps;
        const int32_t *row = pt + r * pt_stride;
        const int32_t gen = R.gen[r];
        const i64 n0 = R.n_pages[r], cl0 = R.chain_len[r];
        i64 k = 0, ncand = 0;
        u64 acc = 0, adopted = 0;
        estart[b] = e;
        /* the reader's own chain over its prefix tokens, when this is a hand-off */
        u64 own = seeds ? (u64)seeds[b] : 0;
        const i64 *tok = ptok;
        if (ptok) {
            i64 off = 0;
            for (i64 bb = 0; bb < b; bb++) off += L[bb];
            tok = ptok + off;
        }
        i64 q = 0; /* next position of the own chain to compute */
        int any_cand = 0, partial_cand = 0;
        for (i64 i = 0; i < np; i++, e++) {
            const i64 head = row[i * ps], pg = head / ps;
            epage[e] = pg;
            efree[e] = 0;
            const int st = P.state[pg], pr = P.prior[pg];
            const i64 fill = P.fill[pg];
            const int mine = P.owner[pg] == r && P.owner_gen[pg] == gen;
            const int lpage_ok = P.lpage[pg] == i, head_ok = head % ps == 0;
            const int cand = ptok && i >= n0;
            if (ps > 1) { /* every position of the page is that page's slot at its offset */
                const i64 hi = (i + 1) * ps < Lb ? (i + 1) * ps : Lb;
                for (i64 p = i * ps; p < hi; p++)
                    if ((i64)row[p] != pg * ps + p % ps) k |= MISPLACED_SLOT;
            }
            if (cand) {
                any_cand = 1;
                ncand++;
                const i64 end = (i + 1) * ps - 1;
                const i64 at = end < Lb - 1 ? end : Lb - 1;
                for (; q <= at; q++) own += chain_term(tok[q], q);
                if (!(end < Lb)) partial_cand = 1;
                if ((u64)P.chain[pg] != own) k |= PREFIX_MISMATCH;
                if (fill != ps) k |= READ_UNWRITTEN;
            }
            const int free_ok = st == FREE && ((pr == OWNED && mine) || pr == SHARED);
            const int quar = st == QUARANTINED;
            const int held_ok = (st == OWNED && mine) || st == SHARED || quar || free_ok;
            const int adopt_ok = st == SHARED || (st == FREE && pr == SHARED);
            const int state_ok = cand ? adopt_ok : held_ok;
            if (!state_ok && !quar) k |= WRONG_OWNER;
            if (cand && quar) k |= QUARANTINED_PAGE;
            if (!lpage_ok || !head_ok) k |= MISPLACED_SLOT;
            const i64 need = Lb - i * ps < ps ? Lb - i * ps : ps;
            if (fill < need) k |= READ_UNWRITTEN;
            const u64 tag = page_tag(P.epoch[pg], i);
            if (cand) adopted += tag; else acc += tag;
            /* checksums */
            int hash = 0;
            if (checksums && ptok && cand) hash = 1;
            if (verify_all) hash = 1;
            else if (window_pages && T) {
                i64 d = ((e - window_start) % T + T) % T;
                if (d < (window_pages < T ? window_pages : T)) hash = 1;
            }
            if (fill <= 0) hash = 0;
            if (hash) { /* hashed below, with every other page of the step */
                hlist[nh] = e;
                hb[nh] = b;
                hq[nh] = (uint8_t)(quar && !cand);
                nh++;
            } else if (quar && !cand) {
                k |= QUARANTINED_PAGE; /* read, not verified intact */
            }
            efree[e] = free_ok && lpage_ok && head_ok && fill >= need;
        }
        if (ptok && any_cand) {
            if (cl0 != n0 * ps) k |= ROW_MISMATCH;
            if (partial_cand) k |= ROW_MISMATCH;
        }
        if (acc != (u64)R.agg[r]) k |= WRONG_OWNER;
        const i64 n1 = n0 + ncand;
        i64 cl1 = cl0, tail1 = R.chain_tail[r];
        if (any_cand) {
            for (; q < Lb; q++) own += chain_term(tok[q], q);
            cl1 = Lb;
            tail1 = (i64)own;
        }
        if (np != n1 || Lb != cl1) k |= ROW_MISMATCH;
        kinds[b] = k;
        o_npages[b] = (int32_t)n1;
        o_agg[b] = (i64)((u64)R.agg[r] + adopted);
        o_clen[b] = (int32_t)cl1;
        o_ctail[b] = tail1;
    }
    estart[B] = e;

    /* ---- checksums: the pages read that this mode hashes, then the resting pages swept ---- */
    {
        const i64 ns = sweep_pages && P.num_pages ? (sweep_pages < P.num_pages ? sweep_pages : P.num_pages) : 0;
        i64 *pages = (i64 *)malloc(sizeof(i64) * (size_t)(nh + ns + 1));
        u64 *found = (u64 *)malloc(sizeof(u64) * (size_t)(nh + ns + 1));
        i64 m = 0;
        if (pages && found) {
            for (i64 x = 0; x < nh; x++) pages[m++] = epage[hlist[x]];
            for (i64 t = 0; t < ns; t++) {
                const i64 pg = (sweep_start + t) % P.num_pages;
                const int st = P.state[pg];
                if ((st == OWNED || st == SHARED) && P.fill[pg] > 0) pages[m++] = pg;
            }
        }
        if (!pages || !found || page_digests(&kv, &P, pages, m, ps, found, &hashed)) {
            free(pages); free(found); free(hlist); free(hq);
            return PyErr_NoMemory();
        }
        for (i64 x = 0; x < nh; x++) {
            const i64 pg = pages[x], b = hb[x];
            const int bad = found[x] != (u64)P.digest[pg];
            if (bad) {
                kinds[b] |= CHECKSUM_MISMATCH;
                MARK(taint, pg);
            }
            if (hq[x] && !(verify_all && !bad)) kinds[b] |= QUARANTINED_PAGE;
        }
        for (i64 x = nh; x < m; x++)
            if (found[x] != (u64)P.digest[pages[x]]) MARK(taint, pages[x]);
        free(pages);
        free(found);
        free(hlist);
        free(hq);
    }

    /* ---- writes ---- */
    Map claims;
    if (map_init(&claims, N)) return PyErr_NoMemory();
    {
        i64 prev_b = -1, kb = 0;
        u64 chain = 0;
        for (i64 j = 0; j < N; j++) {
            const i64 b = wbatch ? wbatch[j] : j, r = rows[b];
            if (b != prev_b) {
                kb = 0;
                chain = o_clen[b] > 0 ? (u64)o_ctail[b] : (seeds ? (u64)seeds[b] : 0);
                prev_b = b;
            }
            const i64 p = wpos[j], s = wslots[j], pg = s / ps, off = s % ps, lp = p / ps;
            targets[j] = s;
            const int pos_ok = p == (i64)o_clen[b] + kb;
            const int table_ok = p < pt_width && (i64)pt[r * pt_stride + p] == s;
            const int in_place = off == p % ps;
            const int claim = off == 0 && in_place;
            const int st = P.state[pg];
            int found = 0, ok = 0;
            i64 k = 0;
            if (claim) {
                i64 *w = map_slot(&claims, pg, &found);
                const int winner = !found;
                if (winner) *w = j;
                ok = winner && st == ALLOCATED && table_ok && pos_ok;
                if (st == OWNED) k |= DOUBLE_ALLOCATION;
                if (st == ALLOCATED && !winner) k |= DOUBLE_ALLOCATION;
                if (st == SHARED) k |= WRITE_TO_SHARED;
                if (st == QUARANTINED) k |= QUARANTINED_PAGE;
                if (st == FREE) k |= WRONG_OWNER;
            } else {
                const int mine = P.owner[pg] == r && P.owner_gen[pg] == R.gen[r];
                const int held_before = st == OWNED && mine && P.lpage[pg] == lp &&
                                        lp < (i64)o_npages[b] && off >= P.fill[pg];
                int held_now = 0;
                i64 *w = map_slot(&claims, pg, &found);
                if (found) {
                    const i64 wj = *w;
                    held_now = wj < j && (wbatch ? wbatch[wj] : wj) == b && wpos[wj] / ps == lp &&
                               claim_ok[wj];
                } else {
                    claims.keys[w - claims.vals] = -1; /* not a claim: leave the map as it was */
                }
                ok = in_place && table_ok && pos_ok && (held_before || held_now);
                if (!(held_before || held_now)) {
                    const int overwrite = st == OWNED && mine && P.lpage[pg] == lp && off < P.fill[pg];
                    if (st == SHARED) k |= WRITE_TO_SHARED;
                    if (overwrite) k |= OVERWRITE;
                    if (st != SHARED && !overwrite) k |= WRONG_OWNER;
                }
            }
            if (!table_ok) k |= TABLE_MISMATCH;
            if (!in_place) k |= MISPLACED_SLOT;
            if (!pos_ok) k |= ROW_MISMATCH;
            kinds[b] |= k;
            claim_ok[j] = (uint8_t)(claim && ok);
            write_ok[j] = (uint8_t)ok;
            chain += chain_term(wtok[j], p);
            write_chain[j] = (i64)chain;
            kb++;
        }
    }
    map_free(&claims);

    /* ---- taint: readers of bad content are flagged; what flagged requests write is tainted ---- */
    for (i64 b = 0; b < B; b++)
        for (i64 x = estart[b]; x < estart[b + 1]; x++)
            if (taint[epage[x]]) kinds[b] |= QUARANTINED_PAGE;
    for (i64 j = 0; j < N; j++) {
        const i64 b = wbatch ? wbatch[j] : j;
        if (write_ok[j] && kinds[b]) MARK(taint, targets[j] / ps);
    }
    int any_kind = 0, any_taint = 0, any_reclaim = 0;
    for (i64 b = 0; b < B; b++) {
        if (kinds[b]) any_kind = 1;
        else
            for (i64 x = estart[b]; x < estart[b + 1]; x++)
                if (efree[x]) MARK(reclaim, epage[x]);
    }
    for (i64 m = 0; m < marks[0] && m < marks_cap; m++) {
        any_taint |= taint[marks[1 + m]];
        any_reclaim |= reclaim[marks[1 + m]];
    }
    if (marks[0] > marks_cap) any_taint = any_reclaim = 1; /* overflowed: the caller scans */
    /* ---- the firewall: a write that failed its check never lands ---- */
    for (i64 j = 0; j < N; j++)
        if (!write_ok[j]) wslots[j] = pad;
    return Py_BuildValue("(iiiL)", any_kind, any_taint, any_reclaim, (long long)hashed);
#undef MARK
}

/* ---- apply_step: claims, page chains, row records (after the check, before the forward) ----
 * args: ctx, step, B, rows, N, write_batch (0: identity), write_pos, page_size, out (check's) */
static PyObject *apply_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[9];
    if (ints(args, nargs, 9, a)) return NULL;
    const i64 *ctx = PTR(const i64 *, a[0]);
    Pages P; Rows R;
    load_pages(&P, ctx + CTX_PAGES);
    load_rows(&R, ctx + CTX_ROWS);
    const i64 step = a[1], B = a[2], N = a[4], ps = a[7];
    const i64 *rows = PTR(const i64 *, a[3]);
    const i64 *wbatch = PTR(const i64 *, a[5]), *wpos = PTR(const i64 *, a[6]);
    const i64 *out = PTR(const i64 *, a[8]);
    const i64 *targets = PTR(const i64 *, out[3]);
    const uint8_t *write_ok = PTR(const uint8_t *, out[4]), *claim_ok = PTR(const uint8_t *, out[5]);
    const i64 *write_chain = PTR(const i64 *, out[6]);
    const int32_t *o_npages = PTR(const int32_t *, out[7]), *o_clen = PTR(const int32_t *, out[9]);
    const i64 *o_agg = PTR(const i64 *, out[8]), *o_ctail = PTR(const i64 *, out[10]);
    for (i64 j = 0; j < N; j++) {
        if (!claim_ok[j]) continue;
        const i64 pg = targets[j] / ps, b = wbatch ? wbatch[j] : j, r = rows[b];
        P.prior[pg] = P.state[pg];
        P.state[pg] = OWNED;
        P.epoch[pg] = (step << EPOCH_STEP_SHIFT) | (j + 1);
        P.owner[pg] = (int32_t)r;
        P.owner_gen[pg] = R.gen[r];
        P.lpage[pg] = (int32_t)(wpos[j] / ps);
        P.fill[pg] = 0;
        P.digest[pg] = 0;
        P.chain[pg] = 0;
        push_history(&P, pg, EV_CLAIM, step, r);
    }
    for (i64 j = 0; j < N; j++)
        if (write_ok[j]) P.chain[targets[j] / ps] = write_chain[j];
    for (i64 b = 0; b < B; b++) {
        const i64 r = rows[b];
        R.n_pages[r] = o_npages[b];
        R.agg[r] = o_agg[b];
        R.chain_len[r] = o_clen[b];
        R.chain_tail[r] = o_ctail[b];
    }
    for (i64 j = 0; j < N; j++) {
        const i64 b = wbatch ? wbatch[j] : j, r = rows[b];
        if (claim_ok[j]) {
            R.n_pages[r] += 1;
            R.agg[r] = (i64)((u64)R.agg[r] + page_tag((step << EPOCH_STEP_SHIFT) | (j + 1), wpos[j] / ps));
        }
        R.chain_len[r] += 1;
        R.chain_tail[r] = write_chain[j];
    }
    Py_RETURN_NONE;
}

/* ---- seal_step: after the forward, landed tokens are sealed (and hashed) ----
 * args: ctx, N, write_pos, page_size, checksums, out (check's), written (0, or the writer's
 * inner sums [N]: the digests come from them instead of from the pool). Returns tokens hashed. */
static PyObject *seal_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[7];
    if (ints(args, nargs, 7, a)) return NULL;
    const u64 *written = PTR(const u64 *, a[6]);
    const i64 *ctx = PTR(const i64 *, a[0]);
    Pages P; Kv kv;
    load_pages(&P, ctx + CTX_PAGES);
    load_kv(&kv, ctx + CTX_KV);
    const i64 N = a[1], ps = a[3];
    const i64 *wpos = PTR(const i64 *, a[2]);
    const int checksums = (int)a[4];
    const i64 *out = PTR(const i64 *, a[5]);
    const i64 *targets = PTR(const i64 *, out[3]);
    const uint8_t *write_ok = PTR(const uint8_t *, out[4]);
    i64 hashed = 0;
    for (i64 j = 0; j < N; j++) {
        if (!write_ok[j]) continue;
        const i64 s = targets[j], pg = s / ps, top = s % ps + 1;
        if (P.fill[pg] < top) P.fill[pg] = (int16_t)top;
    }
    if (checksums && N) {
        i64 *buf = (i64 *)malloc(sizeof(i64) * (size_t)(3 * N));
        u64 *inner = (u64 *)malloc(sizeof(u64) * (size_t)N);
        if (!buf || !inner) {
            free(buf);
            free(inner);
            return PyErr_NoMemory();
        }
        i64 *sl = buf, *po = buf + N, *dg = buf + 2 * N, m = 0;
        for (i64 j = 0; j < N; j++)
            if (write_ok[j]) {
                sl[m] = targets[j];
                po[m++] = wpos[j];
            }
        if (written) {
            for (i64 j = 0, t = 0; j < N; j++)
                if (write_ok[j]) dg[t++] = (i64)fmix64(written[j] ^ splitmix64((u64)wpos[j] + POS_SEED));
        } else {
            token_digests_into(&kv, sl, po, m, inner, dg);
        }
        for (i64 t = 0; t < m; t++) {
            const i64 pg = sl[t] / ps;
            P.digest[pg] = (i64)((u64)P.digest[pg] + (u64)dg[t]);
        }
        hashed = m;
        free(buf);
        free(inner);
    }
    return PyLong_FromLongLong(hashed);
}

/* ---- alloc_pages: the allocator handed out slots (args: ctx, slots, n, page_size, step) ---- */
static PyObject *alloc_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[5];
    if (ints(args, nargs, 5, a)) return NULL;
    Pages P;
    load_pages(&P, PTR(const i64 *, a[0]) + CTX_PAGES);
    const i64 *slots = PTR(const i64 *, a[1]);
    const i64 n = a[2], ps = a[3], step = a[4];
    const i64 packed = (step << 24) | ((i64)EV_ALLOC << 20) | NO_ROW;
    for (i64 t = 0; t < n; t++) {
        if (slots[t] < 0 || slots[t] % ps || slots[t] / ps >= P.num_pages) continue;
        const i64 pg = slots[t] / ps;
        if (P.state[pg] == ALLOCATED && P.history[pg * HISTORY] == packed) continue;
        P.prior[pg] = P.state[pg];
        P.state[pg] = ALLOCATED;
        push_history(&P, pg, EV_ALLOC, step, NO_ROW);
    }
    Py_RETURN_NONE;
}

/* ---- release_pages: pages back to the free list (args: ctx, pages, n, step, keep, double) ---- */
static PyObject *release_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[6];
    if (ints(args, nargs, 6, a)) return NULL;
    Pages P;
    load_pages(&P, PTR(const i64 *, a[0]) + CTX_PAGES);
    const i64 *pages = PTR(const i64 *, a[1]);
    const i64 n = a[2], step = a[3];
    uint8_t *keep = PTR(uint8_t *, a[4]), *dbl = PTR(uint8_t *, a[5]);
    Map seen;
    if (map_init(&seen, n)) return PyErr_NoMemory();
    i64 kept = 0;
    for (i64 t = 0; t < n; t++) {
        const i64 pg = pages[t];
        if (pg < 0 || pg >= P.num_pages) { /* not a page of this pool: never pushed */
            keep[t] = 0;
            dbl[t] = 1;
            continue;
        }
        int found = 0;
        map_slot(&seen, pg, &found);
        const int st = P.state[pg];
        keep[t] = !found && (st == OWNED || st == SHARED || st == ALLOCATED);
        dbl[t] = found || st == FREE;
        if (keep[t]) {
            P.prior[pg] = (uint8_t)st;
            P.state[pg] = FREE;
            push_history(&P, pg, EV_FREE, step, NO_ROW);
            kept++;
        }
    }
    map_free(&seen);
    return PyLong_FromLongLong(kept);
}

/* ---- token_digests: the checksum alone (args: ctx, slots, positions, n, out) ---- */
static PyObject *token_digests(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[5];
    if (ints(args, nargs, 5, a)) return NULL;
    Kv kv;
    load_kv(&kv, PTR(const i64 *, a[0]) + CTX_KV);
    const i64 *slots = PTR(const i64 *, a[1]), *pos = PTR(const i64 *, a[2]);
    const i64 n = a[3];
    i64 *out = PTR(i64 *, a[4]);
    u64 *inner = (u64 *)malloc(sizeof(u64) * (size_t)(n + 1));
    if (!inner) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    token_digests_into(&kv, slots, pos, n, inner, out);
    Py_END_ALLOW_THREADS
    free(inner);
    Py_RETURN_NONE;
}

/* ---- the per-request transitions (guard_ref: share_pages, attribute_free, rebind_row,
 * reset_rows): cheap, but each request makes several, and in torch each costs a dozen operators */

/* share_pages: the prefix cache took row `row`'s pages (args: ctx, pages, n, row, step) */
static PyObject *share_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[5];
    if (ints(args, nargs, 5, a)) return NULL;
    const i64 *ctx = PTR(const i64 *, a[0]);
    Pages P; Rows R;
    load_pages(&P, ctx + CTX_PAGES);
    load_rows(&R, ctx + CTX_ROWS);
    const i64 *pages = PTR(const i64 *, a[1]);
    const i64 n = a[2], row = a[3], step = a[4];
    if (row < 0 || row >= ctx[CTX_NUM_ROWS]) Py_RETURN_NONE;
    for (i64 t = 0; t < n; t++) {
        const i64 pg = pages[t];
        if (pg < 0 || pg >= P.num_pages) continue;
        if (P.state[pg] == OWNED && P.owner[pg] == row && P.owner_gen[pg] == R.gen[row]) {
            P.prior[pg] = OWNED;
            P.state[pg] = SHARED;
            push_history(&P, pg, EV_SHARE, step, row);
        }
    }
    Py_RETURN_NONE;
}

/* attribute_free: which pages a releasing row may free (args: ctx, pages, n, row, keep out) */
static PyObject *attribute_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[5];
    if (ints(args, nargs, 5, a)) return NULL;
    const i64 *ctx = PTR(const i64 *, a[0]);
    Pages P; Rows R;
    load_pages(&P, ctx + CTX_PAGES);
    load_rows(&R, ctx + CTX_ROWS);
    const i64 *pages = PTR(const i64 *, a[1]);
    const i64 n = a[2], row = a[3];
    uint8_t *keep = PTR(uint8_t *, a[4]);
    const int32_t gen = row >= 0 && row < ctx[CTX_NUM_ROWS] ? R.gen[row] : -1;
    i64 kept = 0;
    for (i64 t = 0; t < n; t++) {
        const i64 pg = pages[t];
        if (pg < 0 || pg >= P.num_pages) { /* not a page: the release drops it */
            keep[t] = 1;
            kept++;
            continue;
        }
        const int st = P.state[pg];
        const int mine = P.owner[pg] == row && P.owner_gen[pg] == gen;
        const int other = (st == OWNED && !mine) || st == SHARED || (st == ALLOCATED && P.prior[pg] != FREE);
        keep[t] = (uint8_t)!other;
        kept += !other;
    }
    return PyLong_FromLongLong(kept);
}

/* rebind_row: the prefix cache replaced the row's own copies of logical pages first.. by its
 * own (args: ctx, row, first_lpage, old_pages, new_pages, n, page_size, step) */
static PyObject *rebind_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[8];
    if (ints(args, nargs, 8, a)) return NULL;
    const i64 *ctx = PTR(const i64 *, a[0]);
    Pages P; Rows R;
    load_pages(&P, ctx + CTX_PAGES);
    load_rows(&R, ctx + CTX_ROWS);
    const i64 row = a[1], first = a[2], n = a[5], ps = a[6], step = a[7];
    const i64 *old = PTR(const i64 *, a[3]), *neu = PTR(const i64 *, a[4]);
    if (row < 0 || row >= ctx[CTX_NUM_ROWS]) Py_RETURN_NONE;
    u64 delta = 0;
    for (i64 t = 0; t < n; t++) {
        const i64 o = old[t], w = neu[t], i = first + t;
        if (o < 0 || o >= P.num_pages || w < 0 || w >= P.num_pages) continue;
        if (o != w && P.state[w] == SHARED && P.fill[w] == ps && P.fill[o] == ps && P.lpage[w] == i &&
            P.chain[w] == P.chain[o]) {
            delta += page_tag(P.epoch[w], i) - page_tag(P.epoch[o], i);
            push_history(&P, w, EV_REBIND, step, row);
        }
    }
    R.agg[row] = (i64)((u64)R.agg[row] + delta);
    Py_RETURN_NONE;
}

/* reset_rows: rows handed to new requests (args: ctx, rows, n) */
static PyObject *reset_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[3];
    if (ints(args, nargs, 3, a)) return NULL;
    const i64 *ctx = PTR(const i64 *, a[0]);
    Rows R;
    load_rows(&R, ctx + CTX_ROWS);
    const i64 *rows = PTR(const i64 *, a[1]);
    const i64 n = a[2];
    /* every row gets its generation before this call plus one, repeated rows included */
    int32_t *gen = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n + 1));
    if (!gen) return PyErr_NoMemory();
    for (i64 t = 0; t < n; t++) gen[t] = rows[t] >= 0 && rows[t] < ctx[CTX_NUM_ROWS] ? R.gen[rows[t]] + 1 : 0;
    for (i64 t = 0; t < n; t++) {
        const i64 r = rows[t];
        if (r < 0 || r >= ctx[CTX_NUM_ROWS]) continue;
        R.gen[r] = gen[t];
        R.n_pages[r] = 0;
        R.agg[r] = 0;
        R.chain_len[r] = 0;
        R.chain_tail[r] = 0;
    }
    free(gen);
    Py_RETURN_NONE;
}

/* adoptable: would a reader with these prompt tokens adopt these prefix-cache pages, from
 * position 0 (the hand-off rule, asked at match time)? (args: ctx, page heads (slots), n pages,
 * tokens, n tokens, seed, page_size). Returns 1 or 0. */
static PyObject *adoptable(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[7];
    if (ints(args, nargs, 7, a)) return NULL;
    Pages P;
    load_pages(&P, PTR(const i64 *, a[0]) + CTX_PAGES);
    const i64 *heads = PTR(const i64 *, a[1]), *tok = PTR(const i64 *, a[3]);
    const i64 n = a[2], ntok = a[4], ps = a[6];
    u64 chain = (u64)a[5];
    if (ntok < n * ps) return PyLong_FromLong(0);
    for (i64 i = 0; i < n; i++) {
        const i64 head = heads[i], pg = head / ps;
        if (head < 0 || head % ps || pg >= P.num_pages) return PyLong_FromLong(0);
        for (i64 q = i * ps; q < (i + 1) * ps; q++) chain += chain_term(tok[q], q);
        if (P.state[pg] != SHARED || P.fill[pg] != ps || P.lpage[pg] != i || (u64)P.chain[pg] != chain)
            return PyLong_FromLong(0);
    }
    return PyLong_FromLong(1);
}

static PyMethodDef methods[] = {
    {"check_step", (PyCFunction)(void (*)(void))check_step, METH_FASTCALL, "the step check"},
    {"apply_step", (PyCFunction)(void (*)(void))apply_step, METH_FASTCALL, "claims and row records"},
    {"seal_step", (PyCFunction)(void (*)(void))seal_step, METH_FASTCALL, "seal landed tokens"},
    {"alloc_pages", (PyCFunction)(void (*)(void))alloc_pages, METH_FASTCALL, "allocator hand-out"},
    {"release_pages", (PyCFunction)(void (*)(void))release_pages, METH_FASTCALL, "pages freed"},
    {"token_digests", (PyCFunction)(void (*)(void))token_digests, METH_FASTCALL, "KV checksums"},
    {"share_pages", (PyCFunction)(void (*)(void))share_pages, METH_FASTCALL, "prefix cache took pages"},
    {"attribute_free", (PyCFunction)(void (*)(void))attribute_free, METH_FASTCALL, "frees of a release"},
    {"rebind_row", (PyCFunction)(void (*)(void))rebind_row, METH_FASTCALL, "prefix cache rebind"},
    {"reset_rows", (PyCFunction)(void (*)(void))reset_rows, METH_FASTCALL, "rows to new requests"},
    {"adoptable", (PyCFunction)(void (*)(void))adoptable, METH_FASTCALL, "hand-off rule at match"},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_guard_cpu", NULL, -1, methods, NULL, NULL, NULL, NULL};
PyMODINIT_FUNC PyInit__guard_cpu(void) { return PyModule_Create(&module); }
