/*
 * The refit's sparse passes in C: lorakit.algebra._refitkernel.
 *
 * An optional accelerator for lorakit.algebra.refine (its numpy fallback gives the
 * same bits: both compute x = W + sum_k B[i,k] At[j,k] in float64 term by term in k
 * order, and add each element's contributions to its row's / column's sums in
 * element order, the order np.bincount uses; tests/algebra/test_refine.py compares
 * the two bit for bit).
 *
 * box(bits, fmt, margin, lo, hi, logu) -> nonfinite
 *   The rounding boxes of a module's tuned values: bits uint16 (fmt 0 bfloat16, 1
 *   float16), lo/hi float32 (written: the values margin of the way to the rounding
 *   boundaries below and above, refine.rounding_box's, exact in float32), logu int16
 *   (written: the exponent of each ulp, as np.frexp gives it). Returns the count of
 *   non-finite values (their entries are not meaningful: the caller uses numpy).
 *
 * solve(G, g, mu, r, d) -> None
 *   The damped Gauss-Newton steps d = (G + damp I)^-1 g of each system (G float64
 *   n x r x r, g and d n x r, mu n; damp = mu tr(G) / r, or 1 if tr(G) <= 0) by
 *   Cholesky, in refine._solve's order of operations; a system whose pivot is not
 *   positive gets d = 0.
 *
 * stats(w, bits, fmt, cols, r, b, a[, d]) -> (outside, resid_sq, noise_sq)
 *   Two kinds of pass: with d (float64 rows x cols) it writes d = T - w and gives
 *   resid_sq and noise_sq, outside 0 (not counted); without d, outside and resid_sq,
 *   noise_sq 0 (not summed).
 *   One pass over a module with factors b float64 rows x r and a float64 r x cols
 *   (r = 0: none): x = w + s, s = sum_k b[k] a[k] summed from b[0] a[0] in k order
 *   (float64); outside: elements whose x, rounded once to fmt (to nearest, ties to
 *   even), is not the stored value (bits uint16, fmt 0 bfloat16, 1 float16);
 *   resid_sq: sum of ((T - w) - s)**2; noise_sq: sum of (ulp(T) / 2)**2, both summed
 *   in eight partial sums (element index mod 8 within each block of a row), four
 *   lanes at a time where the compiler has vector extensions (each lane's additions in
 *   the same order); d (optional, float64 rows x cols): written with T - w.

 * scan(w, lo, hi, logu, cols, r, b, a, thr, oidx, ow, olo, ohi, ologu)
 *     -> (count, violators, whole)
 *   One full pass over a module: w, lo, hi float32 rows x cols (the base and the
 *   shrunken box edges), logu int16 (exponent of each ulp), b float64 rows x r, a
 *   float64 r x cols (row-major: the pass runs along each row of A, a vector loop
 *   over independent elements, each summed in k order), thr float64: an element is
 *   active when its slack to the nearer box edge is below thr (negative outside).
 *   Writes the active elements' flat indices (int64, ascending), w, lo, hi (float32)
 *   and logu (int16) into the caller's buffers oidx .. ologu (room for cap elements);
 *   count: how many are active; whole: 0 when a block did not fit in the room left
 *   (only the blocks before it were written: scan again with room for count and a
 *   block); violators: elements outside.

 * accum(idx, w, lo, hi, logu, cols, r, b, at, wtab, side, G, g, loss) -> violators
 *   Over the gathered active set (idx int64, w/lo/hi float32, logu int16 of those
 *   elements): for each element outside its box, residual rr (signed distance
 *   outside) and weight wt = wtab[logu + 512], with s its row (side 0, f = at[j]) or
 *   column (side 1, f = b[i]): loss[s] += (wt*rr)*rr and, when G is non-empty,
 *   G[s, a, b] += (f_a*f_b)*wt (the whole r x r matrix), g[s, k] += (wt*rr)*f_k.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* x86-64 Linux (glibc ifuncs): an AVX2 copy of the scan's loop, chosen at load time */
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

#define OFF 512
#define TAB 1024

static inline double dotx(double x, const double *b, const double *a, Py_ssize_t r) {
    if (r == 8) {  /* the common rank, unrolled (same order of additions) */
        x += b[0] * a[0]; x += b[1] * a[1]; x += b[2] * a[2]; x += b[3] * a[3];
        x += b[4] * a[4]; x += b[5] * a[5]; x += b[6] * a[6]; x += b[7] * a[7];
        return x;
    }
    for (Py_ssize_t k = 0; k < r; k++) x += b[k] * a[k];
    return x;
}

/* c ? a : b without a branch (a compiler turns the double ?: into a jump, which a
   random c mispredicts): a bit mask over the two values, exact */
static inline double pick(int c, double a, double b) {
    uint64_t ua, ub, m = (uint64_t)0 - (uint64_t)(c != 0);
    memcpy(&ua, &a, 8); memcpy(&ub, &b, 8);
    ua = (ua & m) | (ub & ~m);
    memcpy(&a, &ua, 8);
    return a;
}

#define BLK 256  /* elements per block: their x, row, column and residual stay in L1 */

/* The float32 pre-pass. Both passes first compute x in float32 (the factors are
   float32 values, so their float32 copies are exact) with a rigorous bound on its
   distance from the float64 x: |x32 - x64| <= E = (r + 2) 2**-23 (|w| + ||b_i|| ||a_j||)
   + 2**-140, twice the textbook (r + 1) u of a sum of r + 1 terms in any order (u =
   2**-24; Cauchy-Schwarz for sum |b_k a_k|; the last term: products that fall below
   float32's normal range). Only the elements the bound cannot decide (near the
   threshold, or outside the box) are computed again in float64, term by term in k order:
   every decision and every sum is the float64 path's, so the bits are too. */
typedef struct {
    float *b32, *a32, *nb, *na;  /* factors as float32 (b rows x r, a as given), row and column norms */
} F32;

static void f32_free(F32 *f) { free(f->b32); free(f->a32); free(f->nb); free(f->na); }

/* b rows x r; a either r x cols (a_rowmajor) or cols x r; norms rounded up */
static int f32_init(F32 *f, const double *b, Py_ssize_t rows, const double *a, Py_ssize_t cols,
                    Py_ssize_t r, int a_rowmajor) {
    f->b32 = malloc(rows * r * sizeof(float)); f->a32 = malloc(cols * r * sizeof(float));
    f->nb = malloc(rows * sizeof(float)); f->na = malloc(cols * sizeof(float));
    if (!f->b32 || !f->a32 || !f->nb || !f->na) return 0;
    for (Py_ssize_t i = 0; i < rows; i++) {
        double q = 0;
        for (Py_ssize_t k = 0; k < r; k++) {
            f->b32[i * r + k] = (float)b[i * r + k];
            q += b[i * r + k] * b[i * r + k];
        }
        f->nb[i] = (float)(sqrt(q) * (1 + 0x1p-20));
    }
    for (Py_ssize_t j = 0; j < cols; j++) {
        double q = 0;
        for (Py_ssize_t k = 0; k < r; k++) {
            double v = a_rowmajor ? a[k * cols + j] : a[j * r + k];
            f->a32[a_rowmajor ? k * cols + j : j * r + k] = (float)v;
            q += v * v;
        }
        f->na[j] = (float)(sqrt(q) * (1 + 0x1p-20));
    }
    return 1;
}

#define TINY 0x1p-140f

/* w + sum_k b[k] a[k] in float32, in any order (the bound does not depend on it) */
static inline float dot32(float w, const float *b, const float *a, Py_ssize_t r) {
    if (r == 8) {
        float p0 = b[0] * a[0] + b[4] * a[4], p1 = b[1] * a[1] + b[5] * a[5];
        float p2 = b[2] * a[2] + b[6] * a[6], p3 = b[3] * a[3] + b[7] * a[7];
        return w + ((p0 + p2) + (p1 + p3));
    }
    for (Py_ssize_t k = 0; k < r; k++) w += b[k] * a[k];
    return w;
}

/* The float64 check of the scan's undecided element u of a block (x in k order): its
   unconditional stores at oi[cnt] ..., returns 1 when active (slack below th) */
static ALWAYS_INLINE int scan_exact(const float *W, const float *L, const float *H,
                                    const int16_t *U, const double *bi, const double *A,
                                    Py_ssize_t cols, Py_ssize_t r, Py_ssize_t t, Py_ssize_t j,
                                    double th, int64_t *oi, float *ow, float *ol, float *oh,
                                    int16_t *ou, Py_ssize_t *v) {
    double x = (double)W[t];
    for (Py_ssize_t k = 0; k < r; k++) x += bi[k] * A[k * cols + j];
    double s1 = x - (double)L[t], s2 = (double)H[t] - x;
    double sl = s1 < s2 ? s1 : s2;
    *v += sl < 0;
    *oi = t; *ow = W[t]; *ol = L[t]; *oh = H[t]; *ou = U[t];
    return sl < th;
}

#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"  /* the vectors below never cross a call */
/* eight float32 lanes (GCC / clang vector extensions: SSE, AVX2, NEON alike); the
   float32 pre-passes use them (any order of the float32 sum: the bound holds for all),
   a scalar loop does the same work where they are missing */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
static ALWAYS_INLINE v8f ld8(const float *p) { v8f v; memcpy(&v, p, 32); return v; }
static ALWAYS_INLINE v8i ld8i(const int32_t *p) { v8i v; memcpy(&v, p, 32); return v; }
/* four float64 lanes and their integer twins */
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));
typedef uint16_t v4h __attribute__((vector_size(8)));
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef float v4f __attribute__((vector_size(16)));
static ALWAYS_INLINE v4d ld4d(const double *p) { v4d v; memcpy(&v, p, 32); return v; }
/* m ? a : b lane by lane (m: a compare's -1 / 0), exact */
static ALWAYS_INLINE v4d sel4(v4l m, v4d a, v4d b) { return (v4d)((m & (v4l)a) | (~m & (v4l)b)); }
static ALWAYS_INLINE v4l sel4l(v4l m, v4l a, v4l b) { return (m & a) | (~m & b); }
/* 2**e lane by lane (normal exponents), floor(log2 a) of a >= 0 (binade's) */
static ALWAYS_INLINE v4d pow2v(v4l e) { return (v4d)((e + 1023) << 52); }
static ALWAYS_INLINE v4l binadev(v4d a) { return ((v4l)a >> 52) - 1023; }
/* the lanes of a compare's mask (-1 / 0) as bits 0..7 (three folds) */
static ALWAYS_INLINE unsigned lanes8(v8i m) {
    const v8i bit = {1, 2, 4, 8, 16, 32, 64, 128};
    m &= bit;
    m |= __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3);
    m |= __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5);
    m |= __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6);
    return (unsigned)m[0];
}
/* COMPACT[m]: the set lanes of mask m, in order (the rest 0) */
static int32_t COMPACT[256][8];
static void compact_init(void) {
    for (int m = 0; m < 256; m++) {
        int n = 0;
        for (int l = 0; l < 8; l++) COMPACT[m][l] = 0;
        for (int l = 0; l < 8; l++)
            if (m & (1 << l)) COMPACT[m][n++] = l;
    }
}
#endif

#if defined(__GNUC__)
/* scan_block's vector loop: eight elements at a time, x summed in registers, its margin
   (slack less threshold and twice the bound), and the undecided ones (margin not >= 0:
   NaN too) listed in cand without a branch; returns the elements done (a multiple of 8) */
static ALWAYS_INLINE Py_ssize_t scan_vec(const float *W, const float *L, const float *H,
                                         const float *bi32, float nbi, const F32 *f,
                                         Py_ssize_t cols, const Py_ssize_t r, Py_ssize_t t0,
                                         Py_ssize_t j0, Py_ssize_t nb, float th32, float c,
                                         int32_t *cand, Py_ssize_t *ncp) {
    Py_ssize_t u = 0, nc = *ncp;
    for (; u + 8 <= nb; u += 8) {
        v8f x = ld8(W + t0 + u), w = x;
        for (Py_ssize_t k = 0; k < r; k++) x += bi32[k] * ld8(f->a32 + k * cols + j0 + u);
        v8f aw = (v8f)((v8i)w & 0x7fffffff);
        v8f e = c * (aw + nbi * ld8(f->na + j0 + u)) + TINY;
        v8f s1 = x - ld8(L + t0 + u), s2 = ld8(H + t0 + u) - x;
        v8i lt = s1 < s2;
        v8f sl = (v8f)((lt & (v8i)s1) | (~lt & (v8i)s2));
        unsigned mk = lanes8(~(sl - (th32 + 2 * e) >= 0));
        v8i at = ld8i(COMPACT[mk]) + (int32_t)u;
        memcpy(cand + nc, &at, 32);
        nc += __builtin_popcount(mk);
    }
    *ncp = nc;
    return u;
}
#endif

/* One row's elements j0 .. j0+nb: x in float32 (one vector lane per element) and
   its bound; the elements it cannot put beyond the threshold get x in float64 (k
   order), their exact slack and the unconditional stores of the active ones from oi[0]
   on (room for nb); returns how many are active. */
MULTIVERSION static Py_ssize_t scan_block(const float *W, const float *L, const float *H,
                                          const int16_t *U, const double *bi, const float *bi32,
                                          float nbi, const F32 *f, const double *A,
                                          Py_ssize_t cols, Py_ssize_t r, Py_ssize_t t0,
                                          Py_ssize_t j0, Py_ssize_t nb, double th, float c,
                                          int64_t *oi, float *ow, float *ol, float *oh,
                                          int16_t *ou, Py_ssize_t *viol) {
    int32_t cand[BLK + 8];
    Py_ssize_t u = 0, v = 0, nc = 0, cnt = 0;
    const float th32 = (float)(th * (1 + 0x1p-20));
#if defined(__GNUC__)
    if (r == 8)  /* the common rank: the k loop unrolled */
        u = scan_vec(W, L, H, bi32, nbi, f, cols, 8, t0, j0, nb, th32, c, cand, &nc);
    else
        u = scan_vec(W, L, H, bi32, nbi, f, cols, r, t0, j0, nb, th32, c, cand, &nc);
#endif
    for (; u < nb; u++) {  /* the rest one at a time, the same test */
        Py_ssize_t t = t0 + u;
        float x = W[t];
        for (Py_ssize_t k = 0; k < r; k++) x += bi32[k] * f->a32[k * cols + j0 + u];
        float e = c * (fabsf(W[t]) + nbi * f->na[j0 + u]) + TINY;
        float s1 = x - L[t], s2 = H[t] - x, sl = s1 < s2 ? s1 : s2;
        cand[nc] = (int)u;
        nc += !(sl - (th32 + 2 * e) >= 0);
    }
    for (Py_ssize_t q = 0; q < nc; q++) {
        u = cand[q];
        cnt += scan_exact(W, L, H, U, bi, A, cols, r, t0 + u, j0 + u, th, oi + cnt, ow + cnt,
                          ol + cnt, oh + cnt, ou + cnt, &v);
    }
    *viol += v;
    return cnt;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer w, lo, hi, lu, b, at, oi, ow, ol, oh, ou;
    Py_ssize_t cols, r;
    double th;
    if (!PyArg_ParseTuple(args, "y*y*y*y*nny*y*dw*w*w*w*w*", &w, &lo, &hi, &lu, &cols, &r, &b,
                          &at, &th, &oi, &ow, &ol, &oh, &ou))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = w.len / 4, cap = oi.len / 8;
    if (cols <= 0 || r <= 0 || n % cols || lo.len != w.len || hi.len != w.len ||
        lu.len != n * 2 || b.len != (n / cols) * r * 8 || at.len != cols * r * 8 ||
        ow.len != cap * 4 || ol.len != cap * 4 || oh.len != cap * 4 || ou.len != cap * 2) {
        PyErr_SetString(PyExc_ValueError, "_refitkernel.scan: buffer sizes do not match");
        goto done;
    }
    const float *W = w.buf, *L = lo.buf, *H = hi.buf;
    const int16_t *U = lu.buf;
    const double *Bp = b.buf, *Ap = at.buf;
    int64_t *OI = oi.buf;
    float *OW = ow.buf, *OL = ol.buf, *OH = oh.buf;
    int16_t *OU = ou.buf;
    F32 f = {NULL, NULL, NULL, NULL};
    Py_ssize_t cnt = 0, viol = 0, rows = n / cols;
    int whole = 1;
    const float c = (float)((r + 2) * 0x1p-23);
    if (!f32_init(&f, Bp, rows, Ap, cols, r, 1)) { f32_free(&f); PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    /* scratch for the blocks past the caller's room: they are counted, not kept (the
       caller makes room for the count and scans again) */
    int64_t si[BLK]; float sw[BLK], sl[BLK], sh[BLK]; int16_t su[BLK];
    for (Py_ssize_t i = 0; i < rows; i++) {
        for (Py_ssize_t j0 = 0; j0 < cols; j0 += BLK) {
            Py_ssize_t nb = cols - j0 < BLK ? cols - j0 : BLK, t0 = i * cols + j0;
            int room = cnt + nb <= cap;
            cnt += scan_block(W, L, H, U, Bp + i * r, f.b32 + i * r, f.nb[i], &f, Ap, cols, r,
                              t0, j0, nb, th, c, room ? OI + cnt : si, room ? OW + cnt : sw,
                              room ? OL + cnt : sl, room ? OH + cnt : sh, room ? OU + cnt : su,
                              &viol);
            if (!room) cap = whole = 0;  /* nothing more is kept once a block did not fit */
        }
    }
    Py_END_ALLOW_THREADS
    f32_free(&f);
    res = Py_BuildValue("nni", cnt, viol, whole);
done:
    PyBuffer_Release(&w); PyBuffer_Release(&lo); PyBuffer_Release(&hi); PyBuffer_Release(&lu);
    PyBuffer_Release(&b); PyBuffer_Release(&at);
    PyBuffer_Release(&oi); PyBuffer_Release(&ow); PyBuffer_Release(&ol); PyBuffer_Release(&oh);
    PyBuffer_Release(&ou);
    return res;
}

/* the bits of a double, and floor(log2 a) of a normal a >= 0 (zero and the subnormal
   doubles give -1023: the callers clamp to their format's smallest exponent) */
static inline uint64_t dbits(double a) {
    uint64_t u;
    memcpy(&u, &a, 8);
    return u;
}
static inline int binade(double a) { return (int)(dbits(a) >> 52) - 1023; }

/* 2**e for a normal double's exponent, exact */
static inline double pow2(int e) {
    uint64_t u = (uint64_t)(e + 1023) << 52;
    double d;
    memcpy(&d, &u, 8);
    return d;
}

/* A value of format fmt (0 bfloat16, 1 float16) as a double */
static inline double decode(uint16_t v, int fmt) {
    if (fmt == 0) {
        uint32_t u = (uint32_t)v << 16;
        float f;
        memcpy(&f, &u, 4);
        return (double)f;
    }
    int e = (v >> 10) & 0x1f, m = v & 0x3ff;
    double a = e == 0 ? (double)m * 0x1p-24
                      : (e == 31 ? (m ? NAN : INFINITY) : (double)(m | 0x400) * pow2(e - 25));
    return (v & 0x8000) ? -a : a;
}

/* The boxes of n values of one format (fmt a constant where inlined: one loop each),
   without a branch on the data (the signs are random); returns the non-finite count */
static ALWAYS_INLINE Py_ssize_t box_run(const uint16_t *V, Py_ssize_t n, const int fmt, double margin,
                                 float *L, float *H, int16_t *U) {
    const int p = fmt ? 11 : 8, emin = fmt ? -14 : -126;
    const uint16_t inf = fmt ? 0x7c00 : 0x7f80;
    const double tiny = pow2(emin);
    Py_ssize_t bad = 0;
    for (Py_ssize_t t = 0; t < n; t++) {
        uint16_t v = V[t];
        bad += (v & inf) == inf;
        double T = decode(v, fmt), a = fabs(T);
        int E = binade(a);
        int edge = ((dbits(a) & 0xfffffffffffffULL) == 0) & (a > tiny);  /* a power of two above 2**emin */
        E = E < emin ? emin : E;  /* zero and the subnormals: the smallest spacing */
        double u = pow2(E - (p - 1));
        double toward = u - 0.5 * u * edge;  /* the spacing towards zero */
        double neg = (double)(v >> 15), tz = toward * (double)(a != 0);  /* a zero's own side only */
        double up = neg * tz + (1 - neg) * u, down = neg * u + (1 - neg) * tz;  /* one term is 0 */
        L[t] = (float)(T - margin * down);
        H[t] = (float)(T + margin * up);
        U[t] = (int16_t)(E - (p - 1) + 1);  /* np.frexp(u)[1] */
    }
    return bad;
}

MULTIVERSION static Py_ssize_t box_all(const uint16_t *V, Py_ssize_t n, int fmt, double margin,
                                       float *L, float *H, int16_t *U) {
    return fmt ? box_run(V, n, 1, margin, L, H, U) : box_run(V, n, 0, margin, L, H, U);
}

static PyObject *box(PyObject *self, PyObject *args) {
    Py_buffer bits, lo, hi, lu;
    int fmt;
    double margin;
    if (!PyArg_ParseTuple(args, "y*idw*w*w*", &bits, &fmt, &margin, &lo, &hi, &lu))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = bits.len / 2;
    if ((fmt != 0 && fmt != 1) || lo.len != n * 4 || hi.len != n * 4 || lu.len != n * 2) {
        PyErr_SetString(PyExc_ValueError, "_refitkernel.box: buffer sizes do not match");
        goto done;
    }
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = box_all(bits.buf, n, fmt, margin, lo.buf, hi.buf, lu.buf);
    Py_END_ALLOW_THREADS
    res = PyLong_FromSsize_t(bad);
done:
    PyBuffer_Release(&bits); PyBuffer_Release(&lo); PyBuffer_Release(&hi); PyBuffer_Release(&lu);
    return res;
}

/* G[a][c] += (f[a] f[c]) wv for r = 8, each entry as the scalar loop computes it */
#if defined(__GNUC__)
static inline void g8(double *G, const double *f, double wv) {
    v4d f0, f1, w = {wv, wv, wv, wv};
    memcpy(&f0, f, 32); memcpy(&f1, f + 4, 32);
    for (int a = 0; a < 8; a++) {
        v4d fa = {f[a], f[a], f[a], f[a]}, x0, x1;
        memcpy(&x0, G + a * 8, 32); memcpy(&x1, G + a * 8 + 4, 32);
        x0 += (fa * f0) * w; x1 += (fa * f1) * w;
        memcpy(G + a * 8, &x0, 32); memcpy(G + a * 8 + 4, &x1, 32);
    }
}
#else
static inline void g8(double *G, const double *f, double wv) {
    for (int a = 0; a < 8; a++)
        for (int c = 0; c < 8; c++) G[a * 8 + c] += (f[a] * f[c]) * wv;
}
#endif

#if defined(__GNUC__)
/* lane l: the sum of p[l]'s eight lanes (three rounds of pairwise sums) */
static ALWAYS_INLINE v8f hsum8(const v8f *p) {
    v8f a = __builtin_shufflevector(p[0], p[1], 0, 8, 2, 10, 4, 12, 6, 14) +
            __builtin_shufflevector(p[0], p[1], 1, 9, 3, 11, 5, 13, 7, 15);
    v8f b = __builtin_shufflevector(p[2], p[3], 0, 8, 2, 10, 4, 12, 6, 14) +
            __builtin_shufflevector(p[2], p[3], 1, 9, 3, 11, 5, 13, 7, 15);
    v8f c = __builtin_shufflevector(p[4], p[5], 0, 8, 2, 10, 4, 12, 6, 14) +
            __builtin_shufflevector(p[4], p[5], 1, 9, 3, 11, 5, 13, 7, 15);
    v8f d = __builtin_shufflevector(p[6], p[7], 0, 8, 2, 10, 4, 12, 6, 14) +
            __builtin_shufflevector(p[6], p[7], 1, 9, 3, 11, 5, 13, 7, 15);
    v8f ab = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
             __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    v8f cd = __builtin_shufflevector(c, d, 0, 1, 8, 9, 4, 5, 12, 13) +
             __builtin_shufflevector(c, d, 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* accum's float32 pre-pass for rank 8, eight gathered elements at a time: x (each
   element's two factor rows multiplied lane-wise, then summed across), its bound, and
   the elements not surely inside their box listed in cs without a branch; returns the
   elements done (a multiple of 8) */
static ALWAYS_INLINE Py_ssize_t accum_vec(const float *W, const float *L, const float *H,
                                          const F32 *f, const Py_ssize_t *bi_,
                                          const Py_ssize_t *bj_, Py_ssize_t t0, Py_ssize_t nb,
                                          float c, int32_t *cs, Py_ssize_t *ncp) {
    Py_ssize_t u = 0, nc = *ncp;
    for (; u + 8 <= nb; u += 8) {
        v8f p[8], nbv, nav;
        for (int l = 0; l < 8; l++) {
            p[l] = ld8(f->b32 + bi_[u + l] * 8) * ld8(f->a32 + bj_[u + l] * 8);
            nbv[l] = f->nb[bi_[u + l]];
            nav[l] = f->na[bj_[u + l]];
        }
        v8f w = ld8(W + t0 + u), x = w + hsum8(p);
        v8f e2 = 2 * (c * ((v8f)((v8i)w & 0x7fffffff) + nbv * nav) + TINY);
        v8i m = (x - ld8(L + t0 + u) < e2) | (ld8(H + t0 + u) - x < e2);
        unsigned mk = lanes8(m);
        v8i at = ld8i(COMPACT[mk]) + (int32_t)u;
        memcpy(cs + nc, &at, 32);
        nc += __builtin_popcount(mk);
    }
    *ncp = nc;
    return u;
}
#endif

/* accum's loop (below): the sums over the active set; returns the count outside, and
   sets *bad on an index out of range */
MULTIVERSION static Py_ssize_t accum_run(const int64_t *I, Py_ssize_t k, const float *W,
                                         const float *L, const float *H, const int16_t *U,
                                         Py_ssize_t cols, Py_ssize_t rows, Py_ssize_t r,
                                         const double *Bp, const double *Ap, const F32 *fp,
                                         const double *Wt, int side, int full, double *Gp,
                                         double *gp, double *lp, Py_ssize_t np_, int *badp) {
    const F32 f = *fp;
    Py_ssize_t viol = 0;
    int bad = 0;
    /* A block of elements at a time, in three steps: the row and column of each flat
       index (one division per row met: the active set is ascending); x in float32 and
       its bound (F32 above), x in float64 for those not surely inside their box; then,
       in element order as before, the sums of those outside. The same additions in the
       same order as one element at a time in float64, so the same bits. */
    Py_ssize_t i = 0, row0 = 0;
    Py_ssize_t bi_[BLK], bj_[BLK];
    double rs[BLK];
    int32_t vs[BLK], cs[BLK + 8];
    const float c = (float)((r + 2) * 0x1p-23);
    for (Py_ssize_t t0 = 0; t0 < k && !bad; t0 += BLK) {
        Py_ssize_t nb = k - t0 < BLK ? k - t0 : BLK, u = 0;
        for (; u < nb; u++) {
            Py_ssize_t v = I[t0 + u];
            if (v < row0 || v - row0 >= cols) {
                if (v < 0) { bad = 1; break; }
                i = v / cols;
                row0 = i * cols;
            }
            if (i >= rows) { bad = 1; break; }
            bi_[u] = i; bj_[u] = v - row0;
        }
        if (bad) break;
        Py_ssize_t nc = 0, nv = 0;
        u = 0;
#if defined(__GNUC__)
        if (r == 8) u = accum_vec(W, L, H, &f, bi_, bj_, t0, nb, c, cs, &nc);
#endif
        for (; u < nb; u++) {  /* the float32 pre-pass: those not surely inside */
            float x = dot32(W[t0 + u], f.b32 + bi_[u] * r, f.a32 + bj_[u] * r, r);
            float e = c * (fabsf(W[t0 + u]) + f.nb[bi_[u]] * f.na[bj_[u]]) + TINY;
            cs[nc] = (int)u;
            nc += (x - L[t0 + u] < 2 * e) | (H[t0 + u] - x < 2 * e);
        }
        for (Py_ssize_t q0 = 0; q0 < nc; q0++) {  /* float64, k order: those outside */
            u = cs[q0];
            double x = dotx((double)W[t0 + u], Bp + bi_[u] * r, Ap + bj_[u] * r, r);
            double h = (double)H[t0 + u], l = (double)L[t0 + u];
            rs[u] = pick(x > h, x - h, x - l);
            vs[nv] = (int)u;
            nv += (x > h) | (x < l);
        }
        viol += nv;
        for (Py_ssize_t q0 = 0; q0 < nv; q0++) {
            u = vs[q0];
            Py_ssize_t t = t0 + u;
            double rr = rs[u];
            int e = U[t] + OFF;
            double wv = Wt[e < 0 ? 0 : (e >= TAB ? TAB - 1 : e)];
            Py_ssize_t s = side ? bj_[u] : bi_[u];
            const double *f = side ? Bp + bi_[u] * r : Ap + bj_[u] * r;
            double wr = wv * rr;
            lp[s] += wr * rr;
            if (full) {
                double *Gs = Gp + s * np_, *gs = gp + s * r;
                for (Py_ssize_t a = 0; a < r; a++) gs[a] += wr * f[a];
                if (r == 8) {  /* the whole symmetric matrix: two 4-lane rows per a */
                    g8(Gs, f, wv);
                } else {
                    for (Py_ssize_t a = 0; a < r; a++)
                        for (Py_ssize_t c = 0; c < r; c++) Gs[a * r + c] += (f[a] * f[c]) * wv;
                }
            }
        }
    }
    *badp = bad;
    return viol;
}

static PyObject *accum(PyObject *self, PyObject *args) {
    Py_buffer ix, w, lo, hi, lu, b, at, wt, G, g, loss;
    Py_ssize_t cols, r;
    int side;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*nny*y*y*iw*w*w*", &ix, &w, &lo, &hi, &lu, &cols, &r,
                          &b, &at, &wt, &side, &G, &g, &loss))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t k = ix.len / 8, rows = b.len / 8 / (r > 0 ? r : 1);
    Py_ssize_t size = side ? cols : rows, np_ = r * r;
    int full = G.len > 0;
    if (cols <= 0 || r <= 0 || w.len != k * 4 || lo.len != k * 4 || hi.len != k * 4 ||
        lu.len != k * 2 || at.len != cols * r * 8 || wt.len != TAB * 8 ||
        loss.len != size * 8 || (full && (G.len != size * np_ * 8 || g.len != size * r * 8))) {
        PyErr_SetString(PyExc_ValueError, "_refitkernel.accum: buffer sizes do not match");
        goto done;
    }
    const int64_t *I = ix.buf;
    const float *W = w.buf, *L = lo.buf, *H = hi.buf;
    const int16_t *U = lu.buf;
    const double *Bp = b.buf, *Ap = at.buf, *Wt = wt.buf;
    double *Gp = G.buf, *gp = g.buf, *lp = loss.buf;
    Py_ssize_t viol = 0, bad = 0;
    F32 f = {NULL, NULL, NULL, NULL};
    if (!f32_init(&f, Bp, rows, Ap, cols, r, 0)) {
        f32_free(&f);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    int bad_ = 0;
    viol = accum_run(I, k, W, L, H, U, cols, rows, r, Bp, Ap, &f, Wt, side, full, Gp, gp, lp,
                     np_, &bad_);
    bad = bad_;
    Py_END_ALLOW_THREADS
    f32_free(&f);
    if (bad) PyErr_SetString(PyExc_ValueError, "_refitkernel.accum: index out of range");
    else res = PyLong_FromSsize_t(viol);
done:
    PyBuffer_Release(&ix); PyBuffer_Release(&w); PyBuffer_Release(&lo); PyBuffer_Release(&hi);
    PyBuffer_Release(&lu); PyBuffer_Release(&b); PyBuffer_Release(&at); PyBuffer_Release(&wt);
    PyBuffer_Release(&G); PyBuffer_Release(&g); PyBuffer_Release(&loss);
    return res;
}


/* x rounded once to the format of precision p, normal exponents emin..emax (to
   nearest, ties to even; beyond the largest finite value's half ulp: infinity) */
static inline double round_fmt(double x, int p, int emin, int emax) {
    double a = fabs(x);
    int E = binade(a), over = E > emax;
    E = E < emin ? emin : (over ? emax : E);  /* subnormals (and zero): the smallest quantum */
    double q = pow2(E - (p - 1)), y = a * pow2((p - 1) - E);  /* a / q, exact */
    const double big = 0x1p52;  /* y < 2**(p + 1): y + 2**52 rounds to an integer, ties to even */
    double ry = (y + big) - big, v = ry * q;
    v = (over | (v >= pow2(emax + 1))) ? INFINITY : v;
    v = a < INFINITY ? v : a;  /* inf, NaN: as they are */
    return copysign(v, x);
}

#define LANES 8  /* stats' partial sums: independent chains, one per lane */

#if defined(__GNUC__)
/* decode and round_fmt, four lanes at a time: the same operations lane by lane */
static ALWAYS_INLINE v4d decodev(const uint16_t *V, const int fmt) {
    v4h h;
    memcpy(&h, V, 8);
    v4u w = __builtin_convertvector(h, v4u);
    if (fmt == 0) return __builtin_convertvector((v4f)(w << 16), v4d);
    v4i e = (v4i)((w >> 10) & 0x1f), m = (v4i)(w & 0x3ff);
    v4l el = __builtin_convertvector(e, v4l), ml = __builtin_convertvector(m, v4l);
    v4d sub = __builtin_convertvector(m, v4d) * 0x1p-24;
    v4d nrm = __builtin_convertvector(m | 0x400, v4d) * pow2v(el - 25);
    v4d top = sel4(ml != 0, (v4d){NAN, NAN, NAN, NAN}, (v4d){INFINITY, INFINITY, INFINITY, INFINITY});
    v4d a = sel4(el == 0, sub, sel4(el == 31, top, nrm));
    v4l neg = __builtin_convertvector((v4i)(w & 0x8000) != 0, v4l);
    return sel4(neg, -a, a);
}

static ALWAYS_INLINE v4d round_fmtv(v4d x, int p, int emin, int emax) {
    const v4l sign = (v4l)(v4d){-0.0, -0.0, -0.0, -0.0};
    v4d a = (v4d)((v4l)x & ~sign);
    v4l E = binadev(a), over = E > emax;
    E = sel4l(E < emin, (v4l){emin, emin, emin, emin}, sel4l(over, (v4l){emax, emax, emax, emax}, E));
    v4d q = pow2v(E - (p - 1)), y = a * pow2v((p - 1) - E);
    const double big = 0x1p52;
    v4d ry = (y + big) - big, v = ry * q;
    const v4d inf = {INFINITY, INFINITY, INFINITY, INFINITY};
    v = sel4(over | (v >= pow2(emax + 1)), inf, v);
    v = sel4(a < INFINITY, v, a);
    return (v4d)(((v4l)v & ~sign) | ((v4l)x & sign));
}

/* stats_run's loop over eight elements at a time (lanes u % LANES: two vectors of
   partial sums, loaded and stored back, so each lane adds in the scalar order); returns
   the elements done (a multiple of 8) */
static ALWAYS_INLINE Py_ssize_t stats_vec(const float *W, const uint16_t *V, const int fmt,
                                          const double *sb, Py_ssize_t t0, Py_ssize_t nb,
                                          double *Dp, double *rs, double *ns, const int count,
                                          Py_ssize_t *outp) {
    const int p = fmt ? 11 : 8, emin = fmt ? -14 : -126, emax = fmt ? 15 : 127;
    v4d r0 = ld4d(rs), r1 = ld4d(rs + 4), n0 = ld4d(ns), n1 = ld4d(ns + 4);
    v4l out = {0, 0, 0, 0};
    Py_ssize_t u = 0;
    for (; u + 8 <= nb; u += 8) {
        for (int h = 0; h < 2; h++) {
            Py_ssize_t o = u + 4 * h;
            v4d T = decodev(V + t0 + o, fmt);
            v4f w32;
            memcpy(&w32, W + t0 + o, 16);
            v4d wv = __builtin_convertvector(w32, v4d), s4 = ld4d(sb + o);
            if (count) {
                v4d x = round_fmtv(s4 + wv, p, emin, emax);
                v4l ok = (x == T) & (((v4l)x ^ (v4l)T) >= 0);  /* equal, and the same sign */
                out += ~ok & 1;
            }
            v4d d = T - wv, e = d - s4;
            if (h) r1 += e * e; else r0 += e * e;
            if (count) continue;  /* the first pass (no factors): D and the noise */
            memcpy(Dp + t0 + o, &d, 32);
            v4l E = binadev((v4d)((v4l)T & ~(v4l)(v4d){-0.0, -0.0, -0.0, -0.0}));
            E = sel4l(E < emin, (v4l){emin, emin, emin, emin},
                      sel4l(E > emax, (v4l){emax, emax, emax, emax}, E));
            v4d hh = 0.5 * pow2v(E - (p - 1));
            if (h) n1 += hh * hh; else n0 += hh * hh;
        }
    }
    memcpy(rs, &r0, 32); memcpy(rs + 4, &r1, 32);
    memcpy(ns, &n0, 32); memcpy(ns + 4, &n1, 32);
    *outp += out[0] + out[1] + out[2] + out[3];
    return u;
}
#endif

/* One row block of stats (fmt a constant where inlined); the counts and the partial
   sums by lane u % LANES */
static ALWAYS_INLINE Py_ssize_t stats_run(const float *W, const uint16_t *V, const int fmt,
                                   const double *bi, const double *Ap, Py_ssize_t cols,
                                   Py_ssize_t r, Py_ssize_t t0, Py_ssize_t j0, Py_ssize_t nb,
                                   double *Dp, double *rs, double *ns, const int count) {
    const int p = fmt ? 11 : 8, emin = fmt ? -14 : -126, emax = fmt ? 15 : 127;
    double sb[BLK];
    Py_ssize_t u, out = 0;
    for (u = 0; u < nb; u++) sb[u] = r ? bi[0] * Ap[j0 + u] : 0.0;
    for (Py_ssize_t k = 1; k < r; k++) {
        const double bk = bi[k], *ak = Ap + k * cols + j0;
        for (u = 0; u < nb; u++) sb[u] += bk * ak[u];
    }
    u = 0;
#if defined(__GNUC__) && LANES == 8
    u = stats_vec(W, V, fmt, sb, t0, nb, Dp, rs, ns, count, &out);
#endif
    for (; u < nb; u++) {
        double T = decode(V[t0 + u], fmt), wv = (double)W[t0 + u];
        if (count) {
            double x = round_fmt(sb[u] + wv, p, emin, emax);
            out += !((x == T) & (signbit(x) == signbit(T)));
        }
        double d = T - wv, e = d - sb[u];  /* d: exact, two float32 values */
        rs[u % LANES] += e * e;
        if (!Dp) continue;  /* the first pass (no factors): D and the noise */
        Dp[t0 + u] = d;
        int E = binade(fabs(T));
        E = E < emin ? emin : (E > emax ? emax : E);
        double h = 0.5 * pow2(E - (p - 1));
        ns[u % LANES] += h * h;
    }
    return out;
}

MULTIVERSION static Py_ssize_t stats_rows(const float *W, const uint16_t *V, int fmt,
                                          const double *Bp, const double *Ap, Py_ssize_t rows,
                                          Py_ssize_t cols, Py_ssize_t r, double *Dp,
                                          double *rs, double *ns) {
    Py_ssize_t out = 0;
    for (Py_ssize_t i = 0; i < rows; i++)
        for (Py_ssize_t j0 = 0; j0 < cols; j0 += BLK) {
            Py_ssize_t nb = cols - j0 < BLK ? cols - j0 : BLK;
            const double *bi = Bp + i * r;
            Py_ssize_t t0 = i * cols + j0;
            if (Dp)  /* the first pass: no count */
                out += fmt ? stats_run(W, V, 1, bi, Ap, cols, r, t0, j0, nb, Dp, rs, ns, 0)
                           : stats_run(W, V, 0, bi, Ap, cols, r, t0, j0, nb, Dp, rs, ns, 0);
            else
                out += fmt ? stats_run(W, V, 1, bi, Ap, cols, r, t0, j0, nb, Dp, rs, ns, 1)
                           : stats_run(W, V, 0, bi, Ap, cols, r, t0, j0, nb, Dp, rs, ns, 1);
        }
    return out;
}

static PyObject *stats(PyObject *self, PyObject *args) {
    Py_buffer w, bits, b, at, dd = {0};
    int fmt;
    Py_ssize_t cols, r;
    if (!PyArg_ParseTuple(args, "y*y*inny*y*|w*", &w, &bits, &fmt, &cols, &r, &b, &at, &dd))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = w.len / 4;
    if ((fmt != 0 && fmt != 1) || cols <= 0 || r < 0 || n % cols || bits.len != n * 2 ||
        b.len != (n / cols) * r * 8 || at.len != cols * r * 8 || (dd.buf && dd.len != n * 8)) {
        PyErr_SetString(PyExc_ValueError, "_refitkernel.stats: buffer sizes do not match");
        goto done;
    }
    Py_ssize_t out;
    double rs[LANES] = {0}, ns[LANES] = {0};
    Py_BEGIN_ALLOW_THREADS
    out = stats_rows(w.buf, bits.buf, fmt, b.buf, at.buf, n / cols, cols, r, dd.buf, rs, ns);
    Py_END_ALLOW_THREADS
    double rt = 0, nt = 0;
    for (int q = 0; q < LANES; q++) { rt += rs[q]; nt += ns[q]; }
    res = Py_BuildValue("ndd", out, rt, nt);
done:
    PyBuffer_Release(&w); PyBuffer_Release(&bits); PyBuffer_Release(&b); PyBuffer_Release(&at);
    if (dd.buf) PyBuffer_Release(&dd);
    return res;
}

/* The damped steps (G + damp I)^-1 g of n systems of size r, by Cholesky (refine._solve's
   numpy twin does the same operations in the same order) */
static PyObject *solve(PyObject *self, PyObject *args) {
    Py_buffer G, g, mu, d;
    Py_ssize_t r;
    if (!PyArg_ParseTuple(args, "y*y*y*nw*", &G, &g, &mu, &r, &d)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = mu.len / 8;
    if (r <= 0 || r > 64 || G.len != n * r * r * 8 || g.len != n * r * 8 || d.len != n * r * 8) {
        PyErr_SetString(PyExc_ValueError, "_refitkernel.solve: buffer sizes do not match");
        goto done;
    }
    const double *Gp = G.buf, *gp = g.buf, *mp = mu.buf;
    double *dp = d.buf;
    Py_BEGIN_ALLOW_THREADS
    double L[64 * 64], y[64];
    for (Py_ssize_t s = 0; s < n; s++) {
        const double *M = Gp + s * r * r, *b = gp + s * r;
        double *x = dp + s * r;
        double t = M[0];
        for (Py_ssize_t a = 1; a < r; a++) t += M[a * r + a];
        t = t / (double)r;
        double damp = t > 0 ? mp[s] * t : 1.0;
        int ok = 1;
        for (Py_ssize_t j = 0; j < r && ok; j++) {
            double v = M[j * r + j] + damp;
            for (Py_ssize_t q = 0; q < j; q++) v -= L[j * r + q] * L[j * r + q];
            if (!(v > 0)) { ok = 0; break; }
            L[j * r + j] = sqrt(v);
            for (Py_ssize_t i = j + 1; i < r; i++) {
                double w = M[i * r + j];
                for (Py_ssize_t q = 0; q < j; q++) w -= L[i * r + q] * L[j * r + q];
                L[i * r + j] = w / L[j * r + j];
            }
        }
        if (!ok) { for (Py_ssize_t i = 0; i < r; i++) x[i] = 0.0; continue; }
        for (Py_ssize_t i = 0; i < r; i++) {
            double w = b[i];
            for (Py_ssize_t q = 0; q < i; q++) w -= L[i * r + q] * y[q];
            y[i] = w / L[i * r + i];
        }
        for (Py_ssize_t i = r - 1; i >= 0; i--) {
            double w = y[i];
            for (Py_ssize_t q = i + 1; q < r; q++) w -= L[q * r + i] * x[q];
            x[i] = w / L[i * r + i];
        }
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&G); PyBuffer_Release(&g); PyBuffer_Release(&mu); PyBuffer_Release(&d);
    return res;
}

static PyMethodDef methods[] = {
    {"solve", solve, METH_VARARGS, "damped steps by Cholesky (see the file's header)"},
    {"stats", stats, METH_VARARGS, "re-fuse count, residual and noise (see the file's header)"},
    {"box", box, METH_VARARGS, "rounding boxes from the stored bits (see the file's header)"},
    {"scan", scan, METH_VARARGS, "active set of a full pass (see the file's header)"},
    {"accum", accum, METH_VARARGS, "normal equations over the active set"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_refitkernel",
                                    "the refit's sparse passes", -1, methods};

PyMODINIT_FUNC PyInit__refitkernel(void) {
#if defined(__GNUC__)
    compact_init();
#endif
    return PyModule_Create(&module);
}
