/* What kvguard's compiled CPU kernels share (guard_cpu.c, read_verify.c): the 64-bit mixers the
 * torch reference defines (kernels/kv_checksum_ref.py, kernels/guard_ref.py), the token checksum's
 * inner sum of one row, and the argument plumbing of a METH_FASTCALL call whose every argument is
 * an integer (an address, a size or a flag). */
#ifndef KVGUARD_KV_HASH_H
#define KVGUARD_KV_HASH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef uint64_t u64;
typedef int64_t i64;

static const u64 GOLDEN = 0x9E3779B97F4A7C15ULL;
static const u64 SM_M1 = 0xBF58476D1CE4E5B9ULL, SM_M2 = 0x94D049BB133111EBULL;
static const u64 FM1 = 0xFF51AFD7ED558CCDULL, FM2 = 0xC4CEB9FE1A85EC53ULL;
static const u64 POS_SEED = 0x6B76677561726450ULL;

static inline u64 splitmix64(u64 x) {
    u64 z = x + GOLDEN;
    z = (z ^ (z >> 30)) * SM_M1;
    z = (z ^ (z >> 27)) * SM_M2;
    return z ^ (z >> 31);
}
static inline u64 fmix64(u64 x) {
    x ^= x >> 33;
    x *= FM1;
    x ^= x >> 33;
    x *= FM2;
    return x ^ (x >> 33);
}
static inline u64 page_tag(i64 epoch, i64 lpage) { return fmix64((u64)epoch * GOLDEN + (u64)lpage); }

/* The inner part of one slot's row in one buffer, with the buffer's odd 64-bit word constants
 * split in halves: w * C = w * lo + ((w * hi) << 32) (mod 2**64), so the sum vectorizes as a
 * widening 32-bit multiply plus a 32-bit one. */
static inline __attribute__((always_inline)) u64
row_inner(const uint32_t *restrict w, const uint32_t *restrict lo, const uint32_t *restrict hi, i64 n) {
    u64 s1 = 0;
    uint32_t s2 = 0;
    for (i64 j = 0; j < n; j++) {
        s1 += (u64)w[j] * lo[j];
        s2 += w[j] * hi[j];
    }
    return s1 + ((u64)s2 << 32);
}

#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define PTR(T, v) ((T)(uintptr_t)(v))

static int ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, i64 *out) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd integer arguments, got %zd", want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

#endif
