/*
 * Ulp histograms of two float tensors in one pass: lorakit.inspect._ulpkernel, the
 * optional accelerator of lorakit/inspect/ulp_count.py (its numpy path gives the same
 * numbers, bit for bit: tests/inspect/test_ulp_count.py). Distances follow
 * numerics.ulp_distance; NaN against a number is a "NaN mismatch", counted apart.
 * Blocks of 256 elements: an equal block costs a memcmp, otherwise one branch-free
 * pass the compiler vectorises; a block holding an inf or NaN is redone element by
 * element with the exact rules.
 */
#include "_kernel.h"

#define BLOCK 256

typedef struct {
    int64_t differing, nan, max_ulp;
    uint64_t ulp_sum;
    float max_abs;
} Stats;

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0x1Fu) return bits_f32(sign | 0x7F800000u | (man << 13));
    if (exp == 0) {
        float v = (float)man * 5.9604644775390625e-08f; /* man * 2**-24, exact */
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline float to_f32(uint16_t h, int fmt) { return fmt == 0 ? bf16_to_f32(h) : f16_to_f32(h); }

/* counts a block's distances into four interleaved histograms of `cap + 1` */
static inline void count_block(const uint32_t *d, size_t n, uint32_t cap, uint32_t *h4,
                               size_t stride) {
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        uint32_t v0 = d[i] < cap ? d[i] : cap, v1 = d[i + 1] < cap ? d[i + 1] : cap;
        uint32_t v2 = d[i + 2] < cap ? d[i + 2] : cap, v3 = d[i + 3] < cap ? d[i + 3] : cap;
        h4[v0]++;
        h4[stride + v1]++;
        h4[2 * stride + v2]++;
        h4[3 * stride + v3]++;
    }
    for (; i < n; i++) h4[d[i] < cap ? d[i] : cap]++;
}

/* One block, branch-free so that the compiler vectorises it: ulp positions are
   (m ^ s) - s with s = 0 or -1 from the sign bit; |fa - fb| is kept as its bits
   (non-negative floats order like unsigned integers). Returns non-zero when the
   block holds an inf or NaN: then a NaN difference could occur (and f16's fast
   conversion is not exact), and the caller redoes the block element by element. */
#define PASS16(NAME, SPECIAL, TO_F32)                                                       \
    static inline uint32_t NAME(const uint16_t *x, const uint16_t *y, size_t m, uint32_t *d,  \
                                uint32_t *dmax_, uint32_t *diff_, uint32_t *sum_,            \
                                uint32_t *emax_) {                                           \
        uint32_t special = 0, dmax = 0, diff = 0, sum = 0, emax = 0;                         \
        for (size_t i = 0; i < m; i++) {                                                     \
            uint32_t ua = x[i], ub = y[i];                                                   \
            uint32_t ma = ua & 0x7FFFu, mb = ub & 0x7FFFu;                                   \
            int32_t sa = -(int32_t)(ua >> 15), sb = -(int32_t)(ub >> 15);                    \
            int32_t t = (((int32_t)ma ^ sa) - sa) - (((int32_t)mb ^ sb) - sb);               \
            int32_t tm = t >> 31;                                                            \
            uint32_t v = (uint32_t)((t ^ tm) - tm);                                          \
            d[i] = v;                                                                        \
            special |= (uint32_t)(ma SPECIAL) | (uint32_t)(mb SPECIAL);                      \
            diff += ua != ub;                                                                \
            sum += v;                                                                        \
            dmax = v > dmax ? v : dmax;                                                      \
            float fa = TO_F32(ua, ma), fb = TO_F32(ub, mb);                                  \
            uint32_t e = f32_bits(fa - fb) & 0x7FFFFFFFu;                                    \
            emax = e > emax ? e : emax;                                                      \
        }                                                                                    \
        *dmax_ = dmax; *diff_ = diff; *sum_ = sum; *emax_ = emax;                           \
        return special;                                                                      \
    }

static inline float bf16_fast(uint32_t u, uint32_t m) {
    (void)m;
    return bits_f32(u << 16);
}

/* f16 -> f32 for finite values: the magnitude's bits moved to float32's place, times
   2**112 (exact for normal and subnormal halves), then the sign bit */
static inline float f16_fast(uint32_t u, uint32_t m) {
    return bits_f32(f32_bits(bits_f32(m << 13) * 5.192296858534828e+33f) |
                       (u & 0x8000u) << 16);
}

PASS16(pass_bf16, >= 0x7F80u, bf16_fast)
PASS16(pass_f16, >= 0x7C00u, f16_fast)

/* 16-bit formats; `fmt` is a constant where this is inlined (one loop per format) */
static ALWAYS_INLINE void run16(const uint16_t *a, const uint16_t *b, size_t n, const int fmt,
                                uint32_t cap, uint32_t *h4, size_t stride, Stats *st) {
    const uint32_t inf = fmt == 0 ? 0x7F80u : 0x7C00u;
    uint32_t d[BLOCK];
    for (size_t s = 0; s < n; s += BLOCK) {
        size_t m = n - s < BLOCK ? n - s : BLOCK;
        const uint16_t *x = a + s, *y = b + s;
        if (memcmp(x, y, m * sizeof *x) == 0) {
            h4[0] += (uint32_t)m;
            continue;
        }
        uint32_t special, dmax, diff, sum, emax;
        if (fmt == 0)
            special = pass_bf16(x, y, m, d, &dmax, &diff, &sum, &emax);
        else
            special = pass_f16(x, y, m, d, &dmax, &diff, &sum, &emax);
        float fmax_ = bits_f32(emax);
        st->differing += diff;
        if (!special) {
            st->ulp_sum += sum;
            if ((int64_t)dmax > st->max_ulp) st->max_ulp = dmax;
            if (fmax_ > st->max_abs) st->max_abs = fmax_;
            count_block(d, m, cap, h4, stride);
            continue;
        }
        for (size_t i = 0; i < m; i++) { /* inf or NaN in this block: exact rules */
            uint32_t ua = x[i], ub = y[i];
            int na = (ua & 0x7FFFu) > inf, nb = (ub & 0x7FFFu) > inf;
            if (na != nb) {
                st->nan++;
                continue;
            }
            uint32_t v = na ? 0u : d[i];
            st->ulp_sum += v;
            if ((int64_t)v > st->max_ulp) st->max_ulp = v;
            h4[v < cap ? v : cap]++;
            if (!na) {
                float e = fabsf(to_f32((uint16_t)ua, fmt) - to_f32((uint16_t)ub, fmt));
                if (e > st->max_abs) st->max_abs = e;
            }
        }
    }
}

#define RUN16(NAME, FMT)                                                                 \
    MULTIVERSION static void NAME(const uint16_t *a, const uint16_t *b, size_t n, uint32_t cap, \
                                  uint32_t *h4, size_t stride, Stats *st) {                  \
        run16(a, b, n, FMT, cap, h4, stride, st);                                            \
    }
RUN16(run_bf16, 0)
RUN16(run_f16, 1)

/* float32, one block, branch-free (as PASS16, with 64-bit positions: distances reach
   2 * 0x7F800000). Returns non-zero when the block holds an inf or NaN. */
static inline uint32_t pass_f32(const uint32_t *x, const uint32_t *y, size_t m, uint32_t *d,
                                uint32_t cap, uint64_t *dmax_, uint32_t *diff_, uint64_t *sum_,
                                uint32_t *emax_) {
    uint32_t special = 0, diff = 0, emax = 0;
    uint64_t sum = 0, dmax = 0;
    for (size_t i = 0; i < m; i++) {
        uint32_t ua = x[i], ub = y[i];
        uint32_t ma = ua & 0x7FFFFFFFu, mb = ub & 0x7FFFFFFFu;
        int64_t sa = -(int64_t)(ua >> 31), sb = -(int64_t)(ub >> 31);
        int64_t t = (((int64_t)ma ^ sa) - sa) - (((int64_t)mb ^ sb) - sb);
        int64_t tm = t >> 63;
        uint64_t v = (uint64_t)((t ^ tm) - tm);
        d[i] = v < cap ? (uint32_t)v : cap;
        special |= (uint32_t)(ma >= 0x7F800000u) | (uint32_t)(mb >= 0x7F800000u);
        diff += ua != ub;
        sum += v;
        dmax = v > dmax ? v : dmax;
        uint32_t e = f32_bits(bits_f32(ua) - bits_f32(ub)) & 0x7FFFFFFFu;
        emax = e > emax ? e : emax;
    }
    *dmax_ = dmax;
    *diff_ = diff;
    *sum_ = sum;
    *emax_ = emax;
    return special;
}

MULTIVERSION
static void run32(const uint32_t *a, const uint32_t *b, size_t n, uint32_t cap, uint32_t *h4,
                  size_t stride, Stats *st) {
    const uint32_t inf = 0x7F800000u;
    uint32_t d[BLOCK];
    for (size_t s = 0; s < n; s += BLOCK) {
        size_t m = n - s < BLOCK ? n - s : BLOCK;
        const uint32_t *x = a + s, *y = b + s;
        if (memcmp(x, y, m * sizeof *x) == 0) {
            h4[0] += (uint32_t)m;
            continue;
        }
        uint64_t dmax, sum;
        uint32_t diff, emax;
        if (!pass_f32(x, y, m, d, cap, &dmax, &diff, &sum, &emax)) {
            st->differing += diff;
            st->ulp_sum += sum;
            if ((int64_t)dmax > st->max_ulp) st->max_ulp = (int64_t)dmax;
            float fmax_ = bits_f32(emax);
            if (fmax_ > st->max_abs) st->max_abs = fmax_;
            count_block(d, m, cap, h4, stride);
            continue;
        }
        for (size_t i = 0; i < m; i++) { /* inf or NaN in this block: exact rules */
            uint32_t ua = x[i], ub = y[i];
            uint32_t ma = ua & 0x7FFFFFFFu, mb = ub & 0x7FFFFFFFu;
            int na = ma > inf, nb = mb > inf;
            st->differing += ua != ub;
            if (na || nb) {
                if (na != nb) {
                    st->nan++;
                    d[i] = UINT32_MAX; /* left out below */
                } else {
                    d[i] = 0;
                }
                continue;
            }
            int64_t pa = (ua & 0x80000000u) ? -(int64_t)ma : (int64_t)ma;
            int64_t pb = (ub & 0x80000000u) ? -(int64_t)mb : (int64_t)mb;
            int64_t t = pa - pb;
            uint64_t v = (uint64_t)(t < 0 ? -t : t); /* up to 2 * 0x7F800000 */
            st->ulp_sum += v;
            if ((int64_t)v > st->max_ulp) st->max_ulp = (int64_t)v;
            d[i] = v < cap ? (uint32_t)v : cap;
            float e = fabsf(bits_f32(ua) - bits_f32(ub));
            if (e > st->max_abs) st->max_abs = e;
        }
        for (size_t i = 0; i < m; i++)
            if (d[i] != UINT32_MAX) h4[d[i]]++;
    }
}

/* ---- scale statistics (lorakit.inspect.ulp_count.ScaleStats: the same numbers) ----
 * Over the elements whose bits differ, NaN left out: sum of (a - b)**2, sign changes,
 * zero on one side only, min(|a|, |b|) below near_bits, and the largest ulp distance
 * where min(|a|, |b|) >= typ_bits (magnitude bits, from the tensor's rms). */
typedef struct {
    double d2;
    int64_t sc, tz, near, typ;
} Scale;

static inline double val32(uint32_t u, int fmt) {
    return fmt == 2 ? (double)bits_f32(u) : (double)to_f32((uint16_t)u, fmt);
}

/* finite values only (the caller checks): bf16 and f32 by their bits, f16 by f16_fast */
static ALWAYS_INLINE float fval(uint32_t u, const int fmt) {
    return fmt == 2 ? bits_f32(u) : fmt == 0 ? bits_f32(u << 16) : f16_fast(u, u & 0x7FFFu);
}

static ALWAYS_INLINE uint32_t elem(const void *p, size_t i, const int fmt) {
    return fmt == 2 ? ((const uint32_t *)p)[i] : ((const uint16_t *)p)[i];
}

#define FMT_CONSTS(fmt)                                                                 \
    const uint32_t sbit = fmt == 2 ? 31u : 15u;                                         \
    const uint32_t mask = fmt == 2 ? 0x7FFFFFFFu : 0x7FFFu;                             \
    const uint32_t inf = fmt == 2 ? 0x7F800000u : fmt == 0 ? 0x7F80u : 0x7C00u;        \
    (void)sbit; (void)mask; (void)inf

static ALWAYS_INLINE double sumsq_run(const void *a, size_t n, const int fmt) {
    FMT_CONSTS(fmt);
    double total = 0;
    for (size_t s = 0; s < n; s += BLOCK) {
        size_t m = n - s < BLOCK ? n - s : BLOCK;
        const char *x = (const char *)a + s * (fmt == 2 ? 4 : 2);
        float lane[16];
        uint32_t special = 0;
        size_t i = 0;
        for (int k = 0; k < 16; k++) lane[k] = 0.0f;
        for (; i + 16 <= m; i += 16)
            for (int k = 0; k < 16; k++) {
                uint32_t u = elem(x, i + k, fmt);
                float v = fval(u, fmt);
                special |= (uint32_t)((u & mask) >= inf);
                lane[k] += v * v;
            }
        double t = 0;
        for (int k = 0; k < 16; k++) t += lane[k];
        if (special) { /* an inf or NaN: the exact conversion */
            t = 0;
            i = 0;
        }
        for (; i < m; i++) {
            double v = val32(elem(x, i, fmt), fmt);
            t += v * v;
        }
        total += t;
    }
    return total;
}

/* one element, exact rules (a block holding an inf or NaN) */
static ALWAYS_INLINE void scale_slow(uint32_t ua, uint32_t ub, const int fmt, uint32_t nb,
                                     uint32_t tb, Scale *sc) {
    FMT_CONSTS(fmt);
    if (ua == ub) return;
    uint32_t ma = ua & mask, mb = ub & mask;
    if (ma > inf || mb > inf) return;
    int64_t pa = (ua >> sbit) ? -(int64_t)ma : (int64_t)ma;
    int64_t pb = (ub >> sbit) ? -(int64_t)mb : (int64_t)mb;
    int64_t v = pa > pb ? pa - pb : pb - pa;
    uint32_t lo = ma < mb ? ma : mb;
    sc->sc += ((ua ^ ub) >> sbit) & (ma != 0) & (mb != 0);
    sc->tz += (ma == 0) != (mb == 0);
    sc->near += lo < nb;
    if (lo >= tb && v > sc->typ) sc->typ = v;
    if (ma < inf && mb < inf) {
        double d = val32(ua, fmt) - val32(ub, fmt);
        sc->d2 += d * d;
    }
}

static ALWAYS_INLINE void scale_run(const void *a, const void *b, size_t n, const int fmt,
                                    uint32_t nb, uint32_t tb, Scale *sc) {
    FMT_CONSTS(fmt);
    const size_t item = fmt == 2 ? 4 : 2;
    for (size_t s = 0; s < n; s += BLOCK) {
        size_t m = n - s < BLOCK ? n - s : BLOCK;
        const char *x = (const char *)a + s * item, *y = (const char *)b + s * item;
        if (memcmp(x, y, m * item) == 0) continue;
        uint32_t special = 0;
        for (size_t i = 0; i < m; i++)
            special |= (uint32_t)((elem(x, i, fmt) & mask) >= inf) |
                       (uint32_t)((elem(y, i, fmt) & mask) >= inf);
        if (special || m < BLOCK) {
            for (size_t i = 0; i < m; i++)
                scale_slow(elem(x, i, fmt), elem(y, i, fmt), fmt, nb, tb, sc);
            continue;
        }
        float ld[16];
        uint32_t lsc[16], ltz[16], lnear[16], ltyp[16];
        for (int k = 0; k < 16; k++) {
            ld[k] = 0.0f;
            lsc[k] = ltz[k] = lnear[k] = ltyp[k] = 0;
        }
        for (size_t i = 0; i < BLOCK; i += 16)
            for (int k = 0; k < 16; k++) {
                uint32_t ua = elem(x, i + k, fmt), ub = elem(y, i + k, fmt);
                uint32_t ma = ua & mask, mb = ub & mask;
                float d = fval(ua, fmt) - fval(ub, fmt);
                uint32_t ne = (uint32_t)(ua != ub);
                uint32_t lo = mb ^ ((ma ^ mb) & -(uint32_t)(ma < mb)); /* min, no branch */
                /* distance |pos(a) - pos(b)| < 2**32: ma + mb across zero, else |ma - mb| */
                uint32_t sg = (ua ^ ub) >> sbit;
                int32_t t = (int32_t)ma - (int32_t)mb, tm = t >> 31;
                uint32_t v = ((ma + mb) & -sg) | ((uint32_t)((t ^ tm) - tm) & (sg - 1u));
                uint32_t vt = v & -(uint32_t)(lo >= tb);
                uint32_t old = ltyp[k];
                ld[k] += d * d;
                lsc[k] += sg & (uint32_t)(ma != 0) & (uint32_t)(mb != 0);
                ltz[k] += (uint32_t)(ma == 0) ^ (uint32_t)(mb == 0);
                lnear[k] += ne & (uint32_t)(lo < nb);
                ltyp[k] = old ^ ((old ^ vt) & -(uint32_t)(vt > old));
            }
        double td = 0;
        for (int k = 0; k < 16; k++) {
            td += ld[k];
            sc->sc += lsc[k];
            sc->tz += ltz[k];
            sc->near += lnear[k];
            if ((int64_t)ltyp[k] > sc->typ) sc->typ = ltyp[k];
        }
        sc->d2 += td;
    }
}

#define SCALE_FNS(NAME, FMT)                                                            \
    MULTIVERSION static void scale_##NAME(const void *a, const void *b, size_t n, uint32_t nb, \
                                          uint32_t tb, Scale *sc) {                         \
        scale_run(a, b, n, FMT, nb, tb, sc);                                                \
    }                                                                                       \
    MULTIVERSION static double sumsq_##NAME(const void *a, size_t n) { return sumsq_run(a, n, FMT); }
SCALE_FNS(bf16, 0)
SCALE_FNS(f16, 1)
SCALE_FNS(f32, 2)

static PyObject *sumsq(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer ba;
    int fmt;
    if (!PyArg_ParseTuple(args, "y*i", &ba, &fmt)) return NULL;
    PyObject *res = NULL;
    size_t item = fmt == 2 ? 4 : 2;
    if (fmt < 0 || fmt > 2 || ba.len % (Py_ssize_t)item) {
        PyErr_SetString(PyExc_ValueError, "fmt 0 (bf16), 1 (f16) or 2 (f32), whole elements");
        goto done;
    }
    double t;
    size_t n = (size_t)ba.len / item;
    Py_BEGIN_ALLOW_THREADS
    t = fmt == 0 ? sumsq_bf16(ba.buf, n) : fmt == 1 ? sumsq_f16(ba.buf, n) : sumsq_f32(ba.buf, n);
    Py_END_ALLOW_THREADS
    res = PyFloat_FromDouble(t);
done:
    PyBuffer_Release(&ba);
    return res;
}

/* The arguments scale() and accumulate() share: a format code and two buffers holding
   the same whole number of its elements. 0, or -1 with a ValueError set. */
static int check_pair(const Py_buffer *a, const Py_buffer *b, int fmt, size_t item) {
    if (fmt < 0 || fmt > 2) {
        PyErr_SetString(PyExc_ValueError, "fmt must be 0 (bf16), 1 (f16) or 2 (f32)");
        return -1;
    }
    if (a->len != b->len || a->len % (Py_ssize_t)item) {
        PyErr_SetString(PyExc_ValueError, "a and b must hold the same whole number of elements");
        return -1;
    }
    return 0;
}

static PyObject *scale(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer ba, bb;
    int fmt;
    unsigned long long nb, tb;
    if (!PyArg_ParseTuple(args, "y*y*iKK", &ba, &bb, &fmt, &nb, &tb)) return NULL;
    PyObject *res = NULL;
    size_t item = fmt == 2 ? 4 : 2;
    if (check_pair(&ba, &bb, fmt, item) < 0) goto done;
    Scale st = {0.0, 0, 0, 0, 0};
    size_t n = (size_t)ba.len / item;
    uint32_t n32 = nb > UINT32_MAX ? UINT32_MAX : (uint32_t)nb;
    uint32_t t32 = tb > UINT32_MAX ? UINT32_MAX : (uint32_t)tb;
    static void (*const SCALES[3])(const void *, const void *, size_t, uint32_t, uint32_t,
                                   Scale *) = {scale_bf16, scale_f16, scale_f32};
    Py_BEGIN_ALLOW_THREADS
    SCALES[fmt](ba.buf, bb.buf, n, n32, t32, &st);
    Py_END_ALLOW_THREADS
    res = Py_BuildValue("dLLLL", st.d2, (long long)st.sc, (long long)st.tz,
                        (long long)st.near, (long long)st.typ);
done:
    PyBuffer_Release(&ba);
    PyBuffer_Release(&bb);
    return res;
}

static PyObject *accumulate(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer ba, bb, bh;
    int fmt;
    if (!PyArg_ParseTuple(args, "y*y*iw*", &ba, &bb, &fmt, &bh)) return NULL;
    PyObject *res = NULL;
    size_t item = fmt == 2 ? 4 : 2;
    uint32_t *h4 = NULL;
    if (check_pair(&ba, &bb, fmt, item) < 0) goto done;
    if (bh.len % 8 || bh.len < 16) {
        PyErr_SetString(PyExc_ValueError, "hist must be an int64 buffer of max_bin + 2 counters");
        goto done;
    }
    size_t n = (size_t)ba.len / item;
    if (n > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "pieces are limited to 2**32 - 1 elements");
        goto done;
    }
    size_t bins = (size_t)bh.len / 8;
    uint32_t cap = (uint32_t)(bins - 1);
    h4 = calloc(4 * bins, sizeof *h4);
    if (!h4) {
        PyErr_NoMemory();
        goto done;
    }
    Stats st = {0, 0, 0, 0, 0.0f};
    Py_BEGIN_ALLOW_THREADS
    if (fmt == 2)
        run32((const uint32_t *)ba.buf, (const uint32_t *)bb.buf, n, cap, h4, bins, &st);
    else if (fmt == 0)
        run_bf16((const uint16_t *)ba.buf, (const uint16_t *)bb.buf, n, cap, h4, bins, &st);
    else
        run_f16((const uint16_t *)ba.buf, (const uint16_t *)bb.buf, n, cap, h4, bins, &st);
    int64_t *hist = (int64_t *)bh.buf;
    for (size_t k = 0; k < bins; k++)
        hist[k] += (int64_t)h4[k] + h4[bins + k] + h4[2 * bins + k] + h4[3 * bins + k];
    Py_END_ALLOW_THREADS
    res = Py_BuildValue("LLLKd", (long long)st.differing, (long long)st.nan,
                        (long long)st.max_ulp, (unsigned long long)st.ulp_sum,
                        (double)st.max_abs);
done:
    free(h4);
    PyBuffer_Release(&ba);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&bh);
    return res;
}

static PyMethodDef methods[] = {
    {"accumulate", accumulate, METH_VARARGS,
     "accumulate(a, b, fmt, hist) -> (differing, nan_mismatch, max_ulp, ulp_sum, max_abs)\n\n"
     "Ulp distances of two pieces of storage bits (fmt 0 bf16, 1 f16, 2 f32) counted into\n"
     "hist (int64, max_bin + 2 counters, the last for larger distances)."},
    {"scale", scale, METH_VARARGS,
     "scale(a, b, fmt, near_bits, typ_bits)\n"
     "    -> (sumsq_d, sign_changes, to_zero, near_zero, max_ulp_typical)\n\n"
     "Scale statistics of two pieces' differing elements (lorakit.inspect.ulp_count)."},
    {"sumsq", sumsq, METH_VARARGS, "sumsq(a, fmt) -> sum of squares of a piece's values"},
    {NULL, NULL, 0, NULL}};

KERNEL_MODULE(_ulpkernel, "One-pass ulp histograms (see ulp_count.py).", methods)
