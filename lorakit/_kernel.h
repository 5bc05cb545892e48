/*
 * The common preamble of lorakit's C kernels (lorakit/kernels.py lists them): the
 * includes, the per-CPU copies of a loop, bit puns, the output formats' rounding
 * constants (numerics.values._round_consts), one correct rounding from double and the
 * exact decoding of storage bits, the module boilerplate.
 */
#ifndef LORAKIT_KERNEL_H
#define LORAKIT_KERNEL_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifndef _WIN32
#include <pthread.h>
#define HAVE_THREADS 1
#endif


/* x86-64 Linux (glibc ifuncs): an AVX2 copy of each loop, chosen at load time */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif
#if defined(_MSC_VER)
#define ALWAYS_INLINE __forceinline
#else
#define ALWAYS_INLINE inline __attribute__((always_inline))
#endif

typedef union {
    uint64_t u;
    double d;
} Pun64;

typedef union {
    uint32_t u;
    float f;
} Pun32;

static inline uint64_t d_bits(double d) {
    Pun64 p;
    p.d = d;
    return p.u;
}

static inline float bits_f32(uint32_t u) {
    Pun32 p;
    p.u = u;
    return p.f;
}

/* the output format's constants (numerics.values._round_consts) */
typedef struct {
    int p, emin, bits;
    uint64_t s, minn, ovf, lim, k, sign_shift, sign, inf, qnan;
    uint64_t dropmask, half, tol;
} Fmt;

static inline void fmt_init(Fmt *f, int code) {
    static const int P[3] = {8, 11, 24}, EMAX[3] = {127, 15, 127}, BITS[3] = {16, 16, 32};
    int p = P[code], emax = EMAX[code];
    f->p = p;
    f->emin = 1 - emax;
    f->bits = BITS[code];
    f->s = (uint64_t)(53 - p);
    f->minn = (uint64_t)(f->emin + 1023) << 52;
    f->ovf = ((uint64_t)(emax + 1023) << 52) | ((((uint64_t)1 << p) - 1) << (f->s - 1));
    f->lim = f->ovf - 1 - f->minn;
    f->k = ((uint64_t)1 << 52) + ((uint64_t)1 << (f->s - 1)) - 1;
    f->sign_shift = (uint64_t)(64 - f->bits);
    f->sign = (uint64_t)1 << (f->bits - 1);
    uint64_t ebits = (uint64_t)(f->bits - p);
    f->inf = (((uint64_t)1 << ebits) - 1) << (p - 1);
    f->qnan = f->inf | ((uint64_t)1 << (p - 2));
    f->dropmask = ((uint64_t)1 << f->s) - 1;
    f->half = (uint64_t)1 << (f->s - 1);
    f->tol = (uint64_t)1 << (f->s - 20);
}

/* numerics.values._round_f64_bits_general, one element: every case */
static inline uint64_t round_general(uint64_t a, const Fmt *f) {
    uint64_t ab = a & 0x7FFFFFFFFFFFFFFFull, res;
    if (ab > 0x7FF0000000000000ull) {
        res = f->qnan;
    } else if (ab >= f->ovf) {
        res = f->inf;
    } else if (ab >= f->minn) {
        uint64_t t = ab - (f->minn - ((uint64_t)1 << 52));
        res = (t + (((uint64_t)1 << (f->s - 1)) - 1) + ((t >> f->s) & 1)) >> f->s;
    } else {
        int64_t e64 = (int64_t)(ab >> 52);
        uint64_t sig = (ab & 0xFFFFFFFFFFFFFull) | (e64 > 0 ? (uint64_t)1 << 52 : 0);
        int64_t e = (e64 > 1 ? e64 : 1) - 1023;
        int64_t sh = f->emin - f->p + 53 - e;
        uint64_t shift = (uint64_t)(sh < 1 ? 1 : sh > 63 ? 63 : sh);
        uint64_t half_m1 = ((uint64_t)1 << (shift - 1)) - 1;
        res = (sig + half_m1 + ((sig >> shift) & 1)) >> shift;
    }
    return res | ((a >> f->sign_shift) & f->sign);
}

static ALWAYS_INLINE double bits_d(uint64_t u) {
    Pun64 p;
    p.u = u;
    return p.d;
}

static inline uint32_t f32_bits(float f) {
    Pun32 p;
    p.f = f;
    return p.u;
}

/* storage bits -> double, exactly (finite or not) */
static ALWAYS_INLINE double load_w(const void *w, size_t i, const int fmt) {
    if (fmt == 2) return (double)bits_f32(((const uint32_t *)w)[i]);
    uint32_t h = ((const uint16_t *)w)[i];
    if (fmt == 0) return (double)bits_f32(h << 16);
    /* float16: the magnitude's bits moved to float32's place, times 2**112 (exact for
       normal and subnormal halves); inf / NaN by their exponent */
    uint32_t m = h & 0x7FFFu, sgn = (h & 0x8000u) << 16;
    float v;
    if (m >= 0x7C00u)
        v = bits_f32(sgn | 0x7F800000u | ((m & 0x3FFu) << 13));
    else
        v = bits_f32(sgn | (m << 13)) * 5.192296858534828e+33f;
    return (double)v;
}

/* the module object and its init function, PyInit_<name> */
#define KERNEL_MODULE(NAME, DOC, METHODS)                                                \
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, #NAME, DOC, -1, METHODS,     \
                                        NULL, NULL, NULL, NULL};                           \
    PyMODINIT_FUNC PyInit_##NAME(void) { return PyModule_Create(&module); }

#endif
