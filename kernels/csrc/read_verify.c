/* Verified reads, compiled for the CPU: attention's own gather of the KV rows a batch reads, with
 * the token checksum folded into it, and the check of those sums against the pages' sealed
 * digests once the last layer has read. Bit-identical to the torch reference
 * (kernels/read_verify_ref.py, the specification; the digest itself is kernels/kv_checksum_ref.py).
 *
 * Why here: attention already reads every KV byte of the read set each step. Hashing the very
 * bytes it copies costs no extra memory traffic and leaves no window between check and use.
 * The token digest is fmix64(inner XOR poskey) with inner = sum over buffers and words of
 * word * C[b, j] (mod 2**64): linear in the buffers, so each layer adds its buffers' part into
 * one accumulator per row read, and the digest is finished after the last layer.
 *
 * A CPython extension with no torch headers: tensors arrive as addresses, sizes as integers.
 */
#include <string.h>

#include "kv_hash.h"

/* Added to a row's accumulator when its slot is outside the pool: nothing is read there, and the
 * row can no longer match any digest (a corrupted page table must not crash the gather). */
static const u64 OUT_OF_POOL = 0xA5A5F00DDEADBEEFULL;

#define PREFETCH_AHEAD 8
#define ROW_COPY_WORDS 1024 /* rows up to 4 KiB are copied once before their scalar lookup */

/* One gathered row: its bytes `row` (row_bytes) become `dst`; with lo/hi, returns the row's inner
 * part as attention reads it (0 without). Each is inlined into its own gather loop below. */
#define ROW_FN static inline __attribute__((always_inline)) u64

/* a copy, hashed from the copy attention reads: no window between check and use */
ROW_FN row_copy(const uint8_t *row, uint8_t *dst, i64 row_bytes, const void *table,
                    const uint32_t *lo, const uint32_t *hi) {
    (void)table;
    memcpy(dst, row, (size_t)row_bytes);
    return lo ? row_inner((const uint32_t *)dst, lo, hi, row_bytes / 4) : 0;
}

/* a byte-by-byte table lookup (FP8 -> 2- or 4-byte values), hashed and looked up from one copy */
#define ROW_LOOKUP(NAME, T)                                                                        \
    ROW_FN NAME(const uint8_t *row, uint8_t *dst, i64 row_bytes, const void *table,                \
                    const uint32_t *lo, const uint32_t *hi) {                                      \
        uint32_t tmp[ROW_COPY_WORDS];                                                              \
        if (row_bytes <= (i64)sizeof(tmp)) {                                                       \
            memcpy(tmp, row, (size_t)row_bytes);                                                   \
            row = (const uint8_t *)tmp;                                                            \
        }                                                                                          \
        const T *t = (const T *)table;                                                             \
        T *d = (T *)dst;                                                                           \
        for (i64 j = 0; j < row_bytes; j++) d[j] = t[row[j]];                                      \
        return lo ? row_inner((const uint32_t *)row, lo, hi, row_bytes / 4) : 0;                   \
    }
ROW_LOOKUP(row_lookup16, uint16_t)
ROW_LOOKUP(row_lookup32, uint32_t)

#if defined(__x86_64__)
/* FP8 byte -> 16-bit value, 64 bytes at a time: the 256-entry table split in its low and high
 * bytes, each looked up with two 128-entry byte permutes (AVX-512 VBMI) and a blend on the top
 * bit, then interleaved back into 16-bit values in order. The words are hashed from the register
 * the lookup loaded (w * C = w * lo + ((w * hi) << 32), lanes reduced once per row). Any row size
 * (the tail masked). */
#include <immintrin.h>
#define VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))
typedef struct {
    __m512i lo[4], hi[4];
} ByteTables;

static int have_vbmi(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vbmi");
    }
    return known;
}

VBMI static void byte_tables(const uint16_t *t, ByteTables *bt) {
    uint8_t lo[256], hi[256];
    for (int i = 0; i < 256; i++) {
        lo[i] = (uint8_t)(t[i] & 0xFF);
        hi[i] = (uint8_t)(t[i] >> 8);
    }
    for (int k = 0; k < 4; k++) {
        bt->lo[k] = _mm512_loadu_si512((const void *)(lo + 64 * k));
        bt->hi[k] = _mm512_loadu_si512((const void *)(hi + 64 * k));
    }
}

VBMI static inline __attribute__((always_inline)) u64 row_lookup16_vbmi(const uint8_t *src, uint8_t *dst8, i64 n, const void *table,
                                  const uint32_t *lo, const uint32_t *hi) {
    const ByteTables *bt = (const ByteTables *)table;
    uint16_t *dst = (uint16_t *)dst8;
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    __m512i s64 = _mm512_setzero_si512(), s32 = _mm512_setzero_si512();
    for (i64 off = 0; off < n; off += 64) {
        const i64 left = n - off;
        const __mmask64 m = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        const __m512i x = _mm512_maskz_loadu_epi8(m, src + off);
        if (lo) {
            const __mmask16 mw = left >= 64 ? (__mmask16)0xFFFF : (__mmask16)(((unsigned)1 << (left / 4)) - 1);
            const __m512i clo = _mm512_maskz_loadu_epi32(mw, lo + off / 4);
            const __m512i chi = _mm512_maskz_loadu_epi32(mw, hi + off / 4);
            s64 = _mm512_add_epi64(s64, _mm512_mul_epu32(x, clo));
            s64 = _mm512_add_epi64(s64, _mm512_mul_epu32(_mm512_srli_epi64(x, 32), _mm512_srli_epi64(clo, 32)));
            s32 = _mm512_add_epi32(s32, _mm512_mullo_epi32(x, chi));
        }
        const __mmask64 top = _mm512_movepi8_mask(x);
        const __m512i lo8 = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(bt->lo[0], x, bt->lo[1]),
                                                   _mm512_permutex2var_epi8(bt->lo[2], x, bt->lo[3]));
        const __m512i hi8 = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(bt->hi[0], x, bt->hi[1]),
                                                   _mm512_permutex2var_epi8(bt->hi[2], x, bt->hi[3]));
        const __m512i a = _mm512_unpacklo_epi8(lo8, hi8), b = _mm512_unpackhi_epi8(lo8, hi8);
        const __m512i out0 = _mm512_permutex2var_epi64(a, first, b);
        const __m512i out1 = _mm512_permutex2var_epi64(a, second, b);
        const __mmask32 m0 = left >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
        const __mmask32 m1 = left >= 64 ? ~(__mmask32)0 : left > 32 ? (((__mmask32)1 << (left - 32)) - 1) : 0;
        _mm512_mask_storeu_epi16(dst + off, m0, out0);
        _mm512_mask_storeu_epi16(dst + off + 32, m1, out1);
    }
    if (!lo) return 0;
    const u64 s1 = (u64)_mm512_reduce_add_epi64(s64);
    const uint32_t s2 = (uint32_t)_mm512_reduce_add_epi32(s32);
    return s1 + ((u64)s2 << 32);
}
#endif

/* gather_rows(src, slot_stride, row_bytes, num_slots, rows, n, table, elem, out, lo, hi, acc)
 *
 * out[i] = the row of slot rows[i] (row_bytes bytes from src + slot * slot_stride), copied
 * (table 0) or looked up byte by byte in a 256-entry table of `elem`-byte values (FP8 -> the
 * query dtype, scale included). With lo/hi (the buffer's word constants, row_bytes / 4 each)
 * acc[i] += inner part of the row as read. A slot outside [0, num_slots) is not read: its row
 * is zeros and acc[i] gets OUT_OF_POOL. Returns the number of such rows. */
#define GATHER_LOOP(ROW)                                                                           \
    i64 bad = 0;                                                                                   \
    for (i64 i = 0; i < n; i++) {                                                                  \
        if (i + PREFETCH_AHEAD < n) {                                                              \
            i64 s = rows[i + PREFETCH_AHEAD];                                                      \
            if (s >= 0 && s < num_slots) {                                                         \
                const uint8_t *p = src + s * slot_stride;                                          \
                for (i64 off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);   \
            }                                                                                      \
        }                                                                                          \
        const i64 slot = rows[i];                                                                  \
        uint8_t *dst = out + i * out_row;                                                          \
        if (slot < 0 || slot >= num_slots) {                                                       \
            memset(dst, 0, (size_t)out_row);                                                       \
            if (acc) acc[i] += OUT_OF_POOL;                                                        \
            bad++;                                                                                 \
            continue;                                                                              \
        }                                                                                          \
        const u64 inner = ROW(src + slot * slot_stride, dst, row_bytes, table, lo, hi);            \
        if (acc) acc[i] += inner;                                                                  \
    }                                                                                              \
    return bad;
#define GATHER_ARGS                                                                                \
    const uint8_t *src, i64 slot_stride, i64 row_bytes, i64 num_slots, const i64 *rows, i64 n,     \
        const void *table, i64 out_row, uint8_t *out, const uint32_t *lo, const uint32_t *hi,      \
        u64 *acc
CLONES static i64 gather_copy(GATHER_ARGS) { GATHER_LOOP(row_copy) }
CLONES static i64 gather_lookup16(GATHER_ARGS) { GATHER_LOOP(row_lookup16) }
CLONES static i64 gather_lookup32(GATHER_ARGS) { GATHER_LOOP(row_lookup32) }
#if defined(__x86_64__)
VBMI static i64 gather_lookup16_vbmi(GATHER_ARGS) { GATHER_LOOP(row_lookup16_vbmi) }
#endif
typedef i64 (*GatherFn)(GATHER_ARGS);

static PyObject *gather_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[12];
    if (ints(args, nargs, 12, a)) return NULL;
    const int hashed = a[9] != 0;
    if (a[2] % 4 != 0 || hashed != (a[10] != 0) || hashed != (a[11] != 0) ||
        (a[6] != 0 && a[7] != 2 && a[7] != 4)) {
        PyErr_SetString(PyExc_ValueError, "gather_rows: bad row size, constants or table");
        return NULL;
    }
    GatherFn gather = a[6] == 0 ? gather_copy : a[7] == 2 ? gather_lookup16 : gather_lookup32;
    const void *table = PTR(const void *, a[6]);
    const i64 out_row = a[6] == 0 ? a[2] : a[2] * a[7];
#if defined(__x86_64__)
    ByteTables bt;
    if (a[6] != 0 && a[7] == 2 && have_vbmi()) {
        byte_tables(PTR(const uint16_t *, a[6]), &bt);
        gather = gather_lookup16_vbmi;
        table = &bt;
    }
#endif
    i64 bad;
    Py_BEGIN_ALLOW_THREADS
    bad = gather(PTR(const uint8_t *, a[0]), a[1], a[2], a[3], PTR(const i64 *, a[4]), a[5], table, out_row,
                 PTR(uint8_t *, a[8]), PTR(const uint32_t *, a[9]), PTR(const uint32_t *, a[10]),
                 PTR(u64 *, a[11]));
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(bad);
}

/* hash_rows(src, row_stride, row_bytes, n, lo, hi, acc)
 *
 * The writer's digest: acc[i] += inner part of the row of `row_bytes` bytes at src + i * row_stride
 * (the bytes a layer hands the pool's store for its i-th written token, after the cast to the
 * storage dtype), with the buffer's word constants lo/hi. read_verify_ref.hash_rows is the
 * specification. */
CLONES static void hash_loop(const uint8_t *src, i64 stride, i64 row_bytes, i64 n, const uint32_t *lo,
                             const uint32_t *hi, u64 *acc) {
    for (i64 i = 0; i < n; i++) acc[i] += row_inner((const uint32_t *)(src + i * stride), lo, hi, row_bytes / 4);
}

static PyObject *hash_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[7];
    if (ints(args, nargs, 7, a)) return NULL;
    if (a[2] % 4 != 0 || a[1] % 4 != 0 || a[0] % 4 != 0 || a[3] < 0 || !a[4] || !a[5] || !a[6]) {
        PyErr_SetString(PyExc_ValueError, "hash_rows: rows of whole aligned words, constants and sums");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    hash_loop(PTR(const uint8_t *, a[0]), a[1], a[2], a[3], PTR(const uint32_t *, a[4]),
              PTR(const uint32_t *, a[5]), PTR(u64 *, a[6]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* verify_reads(acc, rows, seq_lens, req_rows, B, ps, num_slots, num_rows, digest, fill, epoch,
 *              agg, bad_req, bad_pages, max_bad)
 *
 * After the last layer: request b read positions [0, seq_lens[b]) through rows[s_b ...] (its
 * segment of the batch's rows, in order), and acc holds the inner sums of what it read. For each
 * logical page j of it, the digests of the positions read there (fmix64(acc ^ poskey(pos))) must
 * add up to the page's sealed digest, the page must be sealed exactly that far (fill), every
 * position must sit at its offset in that one page, and the row's page tags (epoch, j) must add
 * up to what the row holds (agg): the pages attention read are the row's own, whatever the page
 * table said by the time it was read. bad_req[b] = 1 where any of that fails; the pages whose
 * content disagrees (sealed exactly as far as read, in place, digest differs), of readers that do
 * hold them, are listed in bad_pages (at most max_bad).
 * Returns (requests failed << 32) | pages listed. */
static i64 verify_reads_into(const u64 *acc, const i64 *rows, const i64 *seq_lens, const i64 *req_rows,
                             i64 B, i64 ps, i64 num_slots, i64 num_rows, const i64 *digest,
                             const int16_t *fill, const i64 *epoch, const i64 *agg, uint8_t *bad_req,
                             i64 *bad_pages, i64 max_bad) {
    i64 nbad = 0, s = 0, nreq = 0;
    for (i64 b = 0; b < B; b++) {
        const i64 L = seq_lens[b];
        const i64 listed = nbad; /* this request's bad pages start here */
        int bad = 0;
        u64 tags = 0;
        for (i64 j = 0; j * ps < L; j++) {
            const i64 lo = j * ps, hi = (lo + ps < L) ? lo + ps : L;
            const i64 head = rows[s + lo];
            if (head < 0 || head >= num_slots) {
                bad = 1;
                continue;
            }
            const i64 page = head / ps;
            u64 sum = 0;
            int placed = 1;
            for (i64 p = lo; p < hi; p++) {
                const i64 slot = rows[s + p];
                if (slot != page * ps + (p - lo)) placed = 0;
                sum += fmix64(acc[s + p] ^ splitmix64((u64)p + POS_SEED));
            }
            tags += page_tag(epoch[page], j);
            if (!placed || (i64)fill[page] != hi - lo) {
                bad = 1; /* unsealed or misplaced: the request is wrong, not the page's bytes */
            } else if (sum != (u64)digest[page]) {
                bad = 1;
                if (nbad < max_bad) bad_pages[nbad++] = page;
            }
        }
        const i64 row = req_rows[b];
        if (row < 0 || row >= num_rows || tags != (u64)agg[row]) {
            /* not (all) the row's own pages: the reader is wrong, not the pages' content (a
             * page claimed since by its new owner must not be quarantined on a stale read) */
            bad = 1;
            nbad = listed;
        }
        bad_req[b] = (uint8_t)bad;
        nreq += bad;
        s += L;
    }
    return (nreq << 32) | nbad;
}

static PyObject *verify_reads(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    i64 a[15];
    if (ints(args, nargs, 15, a)) return NULL;
    if (a[5] <= 0) {
        PyErr_SetString(PyExc_ValueError, "verify_reads: page size must be positive");
        return NULL;
    }
    const i64 *lens = PTR(const i64 *, a[2]);
    for (i64 b = 0; b < a[4]; b++)
        if (lens[b] < 0) {
            PyErr_SetString(PyExc_ValueError, "verify_reads: a negative read length");
            return NULL;
        }
    i64 n;
    Py_BEGIN_ALLOW_THREADS
    n = verify_reads_into(PTR(const u64 *, a[0]), PTR(const i64 *, a[1]), lens, PTR(const i64 *, a[3]),
                          a[4], a[5], a[6], a[7], PTR(const i64 *, a[8]), PTR(const int16_t *, a[9]),
                          PTR(const i64 *, a[10]), PTR(const i64 *, a[11]), PTR(uint8_t *, a[12]),
                          PTR(i64 *, a[13]), a[14]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(n);
}

static PyMethodDef methods[] = {
    {"gather_rows", (PyCFunction)(void (*)(void))gather_rows, METH_FASTCALL, "gather (and hash) KV rows"},
    {"verify_reads", (PyCFunction)(void (*)(void))verify_reads, METH_FASTCALL, "read sums vs digests"},
    {"hash_rows", (PyCFunction)(void (*)(void))hash_rows, METH_FASTCALL, "the writer's sums of rows"},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_read_verify", NULL, -1, methods, NULL, NULL, NULL, NULL};
PyMODINIT_FUNC PyInit__read_verify(void) { return PyModule_Create(&module); }
