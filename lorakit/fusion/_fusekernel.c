/*
 * The correctly rounded LoRA fuse in one pass: lorakit.fusion._fusekernel.
 *
 * An optional accelerator for lorakit.fusion.core's ``nearest`` rounding of a plain
 * LoRA (DoRA keeps the numpy path). Both give the same bits: the numpy path and this
 * kernel each compute x = W + sum_k Bs[i,k] A[k,j] in float64, round it once to the
 * output format, and flag the elements whose f64 value might round the wrong way;
 * Python redoes those in exact rationals (nearest._redo_exact). After that fix every
 * element is the correctly rounded exact value, which is unique: the summation order
 * here (FMA or not) may differ from numpy's, as the error bound covers any order
 * (tests/fusion/test_nearest.py compares the two bit for bit).
 *
 * fuse_nearest(w, fmt_in, cols, bs, a, row_c, col_max, g, fmt_out, out, threads)
 *     -> (flagged, special)
 *
 *   w        C-contiguous storage bits of the weight, rows x cols elements of fmt_in
 *            (0 bfloat16, 1 float16, 2 float32).
 *   bs       float64 rows x r (B times the scale, per rank column if need be).
 *   a        float64 r x cols.
 *   row_c    float64 rows, col_max float64 cols: |x| < row_c[i] * col_max[j] means
 *            the terms may have cancelled (see core._fuse_nearest).
 *   g        gamma_n = n u / (1 - n u), the relative error bound of the f64 sum.
 *   out      writable rows x cols elements of fmt_out.
 *   flagged  bytes of int64 flat indices to redo exactly (each once, in no order).
 *   special  1 when some f64 sum is inf or NaN (a non-finite weight or adapter):
 *            the caller redoes the tensor on the numpy path, whose NaN rules it
 *            defines (``out`` is then partly written); 0 otherwise.
 *
 * The flags are those of core._near_ties: within 2**-20 ulp of a rounding tie (by
 * the bits for normal results, by the exact scaled fraction for subnormal ones); or
 * |x| below the cancellation bound and its distance to the nearest tie within
 * e = 2 g (|W| + sum_k |Bs[i,k] A[k,j]|); or a result that rounds to zero with
 * 0 < e and |x| <= e (the zero's sign is the exact value's).
 *
 * Work goes in tiles of TILE columns (A's tile stays in the L1/L2 cache) across all
 * rows: one vectorised pass accumulates a row's tile in f64, a second rounds it and
 * ORs the flag conditions together; only a tile row with a flag or a special value
 * (subnormal result, overflow) goes through the scalar rules. Rows are split over
 * ``threads`` POSIX threads, with the GIL released.
 *
 * The module also holds the merge check's pass over a plain LoRA (check_lora, below:
 * lorakit.inspect.check), which shares the formats and the rounding, and mlx-lm's
 * fuse order as MLX's CPU backend computes it (fuse_mlx_order, below). Built with
 * -ffp-contract=off (pyproject.toml): its numbers must be its numpy twin's bits.
 */
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

#define TILE 512

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

static void fmt_init(Fmt *f, int code) {
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
static uint64_t round_general(uint64_t a, const Fmt *f) {
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

/* core._tie_distance, one element: a lower bound of |x|'s distance to a tie */
static double tie_distance(double ax, const Fmt *f) {
    int e;
    if (ax == 0)
        e = f->emin + 1;
    else
        (void)frexp(ax, &e);
    int q = (e - 1 > f->emin ? e - 1 : f->emin) - (f->p - 1);
    double ulp = ldexp(1.0, q);
    double r = ax - floor(ax / ulp) * ulp;
    double d1 = fabs(r - 0.5 * ulp), d2 = r + 0.25 * ulp;
    return (d1 < d2 ? d1 : d2) * (1 - ldexp(1.0, -50));
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

typedef struct {
    int64_t *v;
    size_t n, cap;
} Flags;

static int flags_push(Flags *fl, int64_t i) {
    if (fl->n == fl->cap) {
        size_t cap = fl->cap ? 2 * fl->cap : 256;
        int64_t *v = realloc(fl->v, cap * sizeof *v);
        if (!v) return -1;
        fl->v = v;
        fl->cap = cap;
    }
    fl->v[fl->n++] = i;
    return 0;
}

typedef struct {
    const void *w;
    const double *bs, *a, *row_c, *col_max;
    double g;
    void *out;
    size_t r0, r1, cols, rank;
    int fin, fout;
    Fmt f;
    Flags fl;
    int special, nomem;
} Job;

/* one tile row, the scalar rules: its flags and its special (non-normal) results */
static ALWAYS_INLINE int tile_slow(Job *jb, size_t i, size_t j0, size_t m, const double *x,
                                   const int fin, const int fout) {
    const Fmt *f = &jb->f;
    const double rc = jb->row_c[i];
    for (size_t t = 0; t < m; t++) {
        size_t j = j0 + t;
        uint64_t a = d_bits(x[t]), ab = a & 0x7FFFFFFFFFFFFFFFull;
        if (ab >= 0x7FF0000000000000ull) return 1; /* inf or NaN: numpy's rules */
        double ax = fabs(x[t]);
        int near;
        if (ab < f->minn) { /* subnormal result: fixed spacing, the scaled fraction */
            double y = ax * ldexp(1.0, f->p - 1 - f->emin);
            near = fabs((y - floor(y)) - 0.5) < ldexp(1.0, -20);
        } else {
            near = ((ab & f->dropmask) - f->half + f->tol) <= 2 * f->tol;
        }
        /* rounds to zero: the sign is the exact value's, certain where |x| > error */
        int zero = ab < f->minn && ax * ldexp(1.0, f->p - 1 - f->emin) <= 0.5;
        if (!near && (zero || rc * jb->col_max[j] > ax)) { /* its own error bound */
            double s = 0;
            const double *b = jb->bs + i * jb->rank;
            for (size_t k = 0; k < jb->rank; k++) s += fabs(b[k]) * fabs(jb->a[k * jb->cols + j]);
            double wa = fabs(load_w(jb->w, i * jb->cols + j, fin));
            double err = 2 * jb->g * (wa + s);
            if (rc * jb->col_max[j] > ax) near = tie_distance(ax, f) <= err;
            if (zero && ax <= err && err > 0) near = 1;
        }
        if (near && flags_push(&jb->fl, (int64_t)(i * jb->cols + j)) < 0) {
            jb->nomem = 1;
            return 1;
        }
        if (ab < f->minn || ab - f->minn > f->lim) {
            uint64_t o = round_general(a, f);
            if (fout == 2)
                ((uint32_t *)jb->out)[i * jb->cols + j] = (uint32_t)o;
            else
                ((uint16_t *)jb->out)[i * jb->cols + j] = (uint16_t)o;
        }
    }
    return 0;
}

static ALWAYS_INLINE void run(Job *jb, const int fin, const int fout) {
    const Fmt *f = &jb->f;
    const size_t cols = jb->cols, rank = jb->rank;
    const uint64_t s = f->s, k = f->k, minn = f->minn, lim = f->lim, sgn = f->sign;
    const uint64_t sshift = f->sign_shift, dmask = f->dropmask, half = f->half;
    const uint64_t tol = f->tol, tol2 = 2 * f->tol;
    double x[TILE];
    for (size_t j0 = 0; j0 < cols; j0 += TILE) {
        size_t m = cols - j0 < TILE ? cols - j0 : TILE;
        for (size_t i = jb->r0; i < jb->r1; i++) {
            const size_t base = i * cols + j0;
            for (size_t t = 0; t < m; t++) x[t] = load_w(jb->w, base + t, fin);
            const double *b = jb->bs + i * rank;
            for (size_t kk = 0; kk < rank; kk++) {
                const double bk = b[kk];
                const double *ar = jb->a + kk * cols + j0;
                for (size_t t = 0; t < m; t++) x[t] += bk * ar[t];
            }
            /* round (the normal range), and OR the flag conditions together */
            const double rc = jb->row_c[i];
            const double *cm = jb->col_max + j0;
            uint64_t any = 0;
            for (size_t t = 0; t < m; t++) {
                /* + 0.0: an exact zero is +0, as numpy's sum (products from +0, then W) */
                x[t] += 0.0;
                uint64_t a = d_bits(x[t]);
                uint64_t ab = a & 0x7FFFFFFFFFFFFFFFull;
                uint64_t d = ab - minn;
                uint64_t o = (d + ((d >> s) & 1) + k) >> s;
                o |= (a >> sshift) & sgn;
                any |= (uint64_t)(d > lim);
                any |= (uint64_t)(((ab & dmask) - half + tol) <= tol2);
                any |= (uint64_t)(rc * cm[t] > fabs(x[t]));
                if (fout == 2)
                    ((uint32_t *)jb->out)[base + t] = (uint32_t)o;
                else
                    ((uint16_t *)jb->out)[base + t] = (uint16_t)o;
            }
            if (any && tile_slow(jb, i, j0, m, x, fin, fout)) {
                jb->special = 1;
                return;
            }
        }
    }
}

/* one function per (input, output) format pair, each with an AVX2 copy */
#define RUN(FI, FO)                                                       \
    MULTIVERSION static void run_##FI##_##FO(Job *jb) { run(jb, FI, FO); }
RUN(0, 0) RUN(0, 1) RUN(0, 2) RUN(1, 0) RUN(1, 1) RUN(1, 2) RUN(2, 0) RUN(2, 1) RUN(2, 2)
static void (*const RUNS[3][3])(Job *) = {{run_0_0, run_0_1, run_0_2},
                                          {run_1_0, run_1_1, run_1_2},
                                          {run_2_0, run_2_1, run_2_2}};

static void *job_main(void *arg) {
    Job *jb = (Job *)arg;
    RUNS[jb->fin][jb->fout](jb);
    return NULL;
}

/* The buffers' sizes against one another. 0, or -1 with a ValueError set. */
static int check_args(const Py_buffer *w, const Py_buffer *bs, const Py_buffer *a,
                      const Py_buffer *rc, const Py_buffer *cm, const Py_buffer *out, int fin,
                      int fout, Py_ssize_t cols, size_t *rows, size_t *rank) {
    static const size_t ITEM[3] = {2, 2, 4};
    if (fin < 0 || fin > 2 || fout < 0 || fout > 2) {
        PyErr_SetString(PyExc_ValueError, "formats must be 0 (bf16), 1 (f16) or 2 (f32)");
        return -1;
    }
    if (cols <= 0 || w->len % (Py_ssize_t)(ITEM[fin] * cols) || cm->len != 8 * cols ||
        a->len % (8 * cols)) {
        PyErr_SetString(PyExc_ValueError, "w, a and col_max must hold whole rows of cols");
        return -1;
    }
    *rows = (size_t)w->len / (ITEM[fin] * (size_t)cols);
    *rank = (size_t)a->len / (8 * (size_t)cols);
    if (rc->len != (Py_ssize_t)(8 * *rows) || bs->len != (Py_ssize_t)(8 * *rows * *rank) ||
        out->len != (Py_ssize_t)(ITEM[fout] * *rows * (size_t)cols)) {
        PyErr_SetString(PyExc_ValueError,
                        "bs (rows x r), row_c (rows) and out (rows x cols) must fit w and a");
        return -1;
    }
    return 0;
}

static PyObject *fuse_nearest(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer w, bs, a, rc, cm, out;
    int fin, fout, threads;
    Py_ssize_t cols;
    double g;
    if (!PyArg_ParseTuple(args, "y*iny*y*y*y*diw*i", &w, &fin, &cols, &bs, &a, &rc, &cm, &g,
                          &fout, &out, &threads))
        return NULL;
    PyObject *res = NULL;
    Job jobs[2];
    int nj = 0;
    size_t rows, rank;
    if (check_args(&w, &bs, &a, &rc, &cm, &out, fin, fout, cols, &rows, &rank) < 0) goto done;
    nj = threads >= 2 && rows >= 64 ? 2 : 1;
    for (int t = 0; t < nj; t++) {
        Job *jb = &jobs[t];
        memset(jb, 0, sizeof *jb);
        jb->w = w.buf;
        jb->bs = (const double *)bs.buf;
        jb->a = (const double *)a.buf;
        jb->row_c = (const double *)rc.buf;
        jb->col_max = (const double *)cm.buf;
        jb->g = g;
        jb->out = out.buf;
        jb->cols = (size_t)cols;
        jb->rank = rank;
        jb->fin = fin;
        jb->fout = fout;
        jb->r0 = rows * (size_t)t / (size_t)nj;
        jb->r1 = rows * (size_t)(t + 1) / (size_t)nj;
        fmt_init(&jb->f, fout);
    }
    Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_THREADS
    pthread_t th;
    if (nj == 2 && pthread_create(&th, NULL, job_main, &jobs[1]) != 0) {
        job_main(&jobs[1]); /* no thread to be had: in turn */
        nj = -2;
    }
    job_main(&jobs[0]);
    if (nj == 2) pthread_join(th, NULL);
    if (nj == -2) nj = 2;
#else
    for (int t = 0; t < nj; t++) job_main(&jobs[t]);
#endif
    Py_END_ALLOW_THREADS
    int special = 0, nomem = 0;
    size_t total = 0;
    for (int t = 0; t < nj; t++) {
        special |= jobs[t].special;
        nomem |= jobs[t].nomem;
        total += jobs[t].fl.n;
    }
    if (nomem) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *flagged = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * total));
    if (!flagged) goto done;
    char *p = PyBytes_AS_STRING(flagged);
    for (int t = 0; t < nj; t++) {
        if (jobs[t].fl.n) memcpy(p, jobs[t].fl.v, 8 * jobs[t].fl.n);
        p += 8 * jobs[t].fl.n;
    }
    res = Py_BuildValue("Ni", flagged, special);
done:
    for (int t = 0; t < nj; t++) free(jobs[t].fl.v);
    PyBuffer_Release(&w);
    PyBuffer_Release(&bs);
    PyBuffer_Release(&a);
    PyBuffer_Release(&rc);
    PyBuffer_Release(&cm);
    PyBuffer_Release(&out);
    return res;
}

/* ---------------------------------------------------------------------------------
 * The merge check's measure of a plain LoRA block: lorakit.inspect.check.
 *
 * check_lora(w, fin, f, fout, fwork, cols, bs, a, c32, carry)
 *     -> (special, dist, max_ulp, beyond, changed, rd, rr, dd, qd, uu)
 *
 *   w      C-contiguous base values, rows x cols of fin (0 bf16, 1 f16, 2 f32 bits,
 *          3 float64 values: a dequantized base).
 *   f      the fused weight's storage bits, rows x cols of fout (0, 1, 2).
 *   fwork  the working format (the base weight's dtype: 0, 1, 2).
 *   bs     float64 rows x r (B times the scale), a float64 r x cols.
 *   c32    (r + 2) 2**-24, the f32 dot product's relative error.
 *   carry  (rd, rr, dd, qd, uu): the running sums, continued here row by row.
 *
 * Per element, exactly the operations of check._lora_numpy (its numpy twin, the same
 * bits: no FMA, -ffp-contract=off, each sum in one fixed order): D = sum_k bs[i,k]
 * a[k,j] and S = sum_k |bs[i,k] a[k,j]| from -0.0 in k order, X = W + D, the rounding
 * bound e of check.float_bound, err = |F - X|; dist = max err / e, max_ulp =
 * max err / ulp_out(X), beyond = #(err / e > 1), changed = #(F != W); and the sums of
 * (F - W)(X - W), (F - W)^2, (X - W)^2, (round_out(X) - W)(X - W) and ulp_out(W)^2,
 * each sequential along a row from -0.0, the rows then added to the carry in order.
 * special is 1 (nothing else meaningful) when a value is inf or NaN or X rounds to
 * inf: the caller measures such a block on the numpy path.
 *
 * Tiles of TILE columns across all rows (A's tile stays in cache), each row's sums
 * carried from tile to tile so that the order along the row is kept.
 */
static ALWAYS_INLINE double bits_d(uint64_t u) {
    Pun64 p;
    p.u = u;
    return p.d;
}

/* numerics.ulp's constants: the f64 exponent field clamped to [emin, emax], less p - 1 */
typedef struct {
    uint64_t lo, hi, msh;
} UlpC;

static void ulpc_init(UlpC *u, int code) {
    static const int P[3] = {8, 11, 24}, EMAX[3] = {127, 15, 127};
    u->lo = (uint64_t)(1 - EMAX[code] + 1023) << 52;
    u->hi = (uint64_t)(EMAX[code] + 1023) << 52;
    u->msh = (uint64_t)(P[code] - 1) << 52;
}

static ALWAYS_INLINE double ulp_c(double x, uint64_t lo, uint64_t hi, uint64_t msh) {
    /* signed compares (the fields are below 2**63): AVX2 has them, not unsigned ones */
    int64_t e = (int64_t)(d_bits(x) & 0x7FF0000000000000ull);
    e = e < (int64_t)lo ? (int64_t)lo : e;
    e = e > (int64_t)hi ? (int64_t)hi : e;
    return bits_d((uint64_t)e - msh);
}

/* 1 / ulp_c(x): the power of two with the negated exponent (2046 - E for 2**(E - 1023)) */
static ALWAYS_INLINE double inv_ulp(double x, uint64_t lo, uint64_t hi, uint64_t msh) {
    int64_t e = (int64_t)(d_bits(x) & 0x7FF0000000000000ull);
    e = e < (int64_t)lo ? (int64_t)lo : e;
    e = e > (int64_t)hi ? (int64_t)hi : e;
    return bits_d((2046ull << 52) - ((uint64_t)e - msh));
}

static ALWAYS_INLINE double load_any(const void *w, size_t i, const int fmt) {
    if (fmt == 3) return ((const double *)w)[i];
    return load_w(w, i, fmt);
}

/* storage bits of fout -> double */
static ALWAYS_INLINE double from_bits(uint64_t o, const int fout) {
    if (fout == 0) return (double)bits_f32((uint32_t)o << 16);
    if (fout == 2) return (double)bits_f32((uint32_t)o);
    uint16_t h = (uint16_t)o;
    return load_w(&h, 0, 1);
}

#define NSUM 5
#define LANES 8
typedef struct {
    const void *w, *f;
    const double *bs, *a;
    double c32;
    size_t rows, cols, rank;
    int fwork, fout;
    double *rowsum; /* rows x NSUM, the sums along each row so far */
    double dist, ulp;
    int64_t beyond, changed;
    int special;
} MJob;

static ALWAYS_INLINE void check_run(MJob *jb, const int fin, const int fout, const int same) {
    Fmt fo;
    fmt_init(&fo, fout);
    UlpC cw, co;
    ulpc_init(&cw, jb->fwork);
    ulpc_init(&co, fout);
    const uint64_t wlo = cw.lo, whi = cw.hi, wms = cw.msh;
    const uint64_t olo = co.lo, ohi = co.hi, oms = co.msh;
    const uint64_t s = fo.s, k = fo.k, minn = fo.minn, lim = fo.lim, sgn = fo.sign;
    const uint64_t sshift = fo.sign_shift;
    const uint64_t EXP = 0x7FF0000000000000ull;
    const size_t cols = jb->cols, rank = jb->rank;
    const double c32 = jb->c32, u32 = ldexp(1.0, -24);
    double d[TILE], sa[TILE];
    double p0[TILE], p1[TILE], p2[TILE], p3[TILE], p4[TILE];
    int64_t dmax = 0, umaxb = 0; /* the bits of +0.0 */
    int64_t beyond = 0, changed = 0;
    for (size_t j0 = 0; j0 < cols; j0 += TILE) {
        size_t m = cols - j0 < TILE ? cols - j0 : TILE;
        for (size_t i = 0; i < jb->rows; i++) {
            const size_t base = i * cols + j0;
            for (size_t t = 0; t < m; t++) {
                d[t] = -0.0;
                sa[t] = -0.0;
            }
            const double *b = jb->bs + i * rank;
            size_t kk = 0;
            for (; kk + 4 <= rank; kk += 4) { /* four terms a pass, still in k order */
                const double b0 = b[kk], b1 = b[kk + 1], b2 = b[kk + 2], b3 = b[kk + 3];
                const double *a0 = jb->a + kk * cols + j0, *a1 = a0 + cols, *a2 = a1 + cols,
                             *a3 = a2 + cols;
                for (size_t t = 0; t < m; t++) {
                    double p = b0 * a0[t], q = b1 * a1[t], u = b2 * a2[t], v = b3 * a3[t];
                    double dt = d[t], st = sa[t];
                    dt += p;
                    st += fabs(p);
                    dt += q;
                    st += fabs(q);
                    dt += u;
                    st += fabs(u);
                    dt += v;
                    st += fabs(v);
                    d[t] = dt;
                    sa[t] = st;
                }
            }
            for (; kk < rank; kk++) {
                const double bk = b[kk];
                const double *ar = jb->a + kk * cols + j0;
                for (size_t t = 0; t < m; t++) {
                    double p = bk * ar[t];
                    d[t] += p;
                    sa[t] += fabs(p);
                }
            }
            uint64_t any = 0;
            int64_t nb = 0, nc = 0;
            for (size_t t = 0; t < m; t++) {
                double W = load_any(jb->w, base + t, fin);
                double F = load_w(jb->f, base + t, fout);
                double D = d[t], X = W + D, aX = fabs(X), aD = fabs(D), e32 = c32 * sa[t];
                double m1 = aD + e32;
                m1 = m1 + ulp_c(m1, wlo, whi, wms);
                double m2 = aX + e32;
                m2 = m2 + ulp_c(m2, wlo, whi, wms);
                double e = 0.5 * ulp_c(m1, wlo, whi, wms) + 0.5 * ulp_c(m2, wlo, whi, wms);
                e = e + e32;
                e = e + u32 * aX;
                if (!same) {
                    double m3 = aX + e;
                    m3 = m3 + ulp_c(m3, olo, ohi, oms);
                    e = e + 0.5 * ulp_c(m3, olo, ohi, oms);
                }
                double err = fabs(F - X);
                /* err / ulp_out(X) as a product: 1 / 2**q is 2**-q, exact, and so are both */
                double r = err / e, ur = err * inv_ulp(X, olo, ohi, oms);
                /* maxima by the bits: both are finite and >= 0 here (else special) */
                int64_t rb = (int64_t)d_bits(r), ub = (int64_t)d_bits(ur);
                dmax = rb > dmax ? rb : dmax;
                umaxb = ub > umaxb ? ub : umaxb;
                nb += r > 1.0;
                double R = F - W, Dm = X - W;
                nc += R != 0.0;
                uint64_t xa = d_bits(X), ab = xa & 0x7FFFFFFFFFFFFFFFull, dd = ab - minn;
                uint64_t o = ((dd + ((dd >> s) & 1) + k) >> s) | ((xa >> sshift) & sgn);
                any |= (uint64_t)(dd > lim);
                any |= (uint64_t)((d_bits(W) & EXP) == EXP) | (uint64_t)((d_bits(F) & EXP) == EXP) |
                       (uint64_t)((xa & EXP) == EXP);
                double Q = from_bits(o, fout) - W;
                double u = ulp_c(W, olo, ohi, oms);
                p0[t] = R * Dm;
                p1[t] = R * R;
                p2[t] = Dm * Dm;
                p3[t] = Q * Dm;
                p4[t] = u * u;
            }
            if (any) { /* the scalar rules: non-finite values, results out of the normal range */
                for (size_t t = 0; t < m; t++) {
                    double W = load_any(jb->w, base + t, fin);
                    double F = load_w(jb->f, base + t, fout);
                    double X = W + d[t];
                    if ((d_bits(W) & EXP) == EXP || (d_bits(F) & EXP) == EXP ||
                        (d_bits(X) & EXP) == EXP) {
                        jb->special = 1;
                        return;
                    }
                    uint64_t xa = d_bits(X), dd = (xa & 0x7FFFFFFFFFFFFFFFull) - minn;
                    if (dd > lim) {
                        double q = from_bits(round_general(xa, &fo), fout);
                        if ((d_bits(q) & EXP) == EXP) { /* rounds to inf */
                            jb->special = 1;
                            return;
                        }
                        p3[t] = (q - W) * (X - W);
                    }
                }
            }
            beyond += nb;
            changed += nc;
            /* the sums: LANES per row, lane q taking the columns j = q (mod LANES) in
               order (TILE is a multiple of LANES) */
            double *rs = jb->rowsum + i * NSUM * LANES;
            double acc[NSUM][LANES];
            memcpy(acc, rs, sizeof acc);
            size_t t = 0;
            for (; t + LANES <= m; t += LANES)
                for (int q = 0; q < LANES; q++) {
                    acc[0][q] += p0[t + q];
                    acc[1][q] += p1[t + q];
                    acc[2][q] += p2[t + q];
                    acc[3][q] += p3[t + q];
                    acc[4][q] += p4[t + q];
                }
            for (; t < m; t++) {
                int q = (int)(t % LANES);
                acc[0][q] += p0[t];
                acc[1][q] += p1[t];
                acc[2][q] += p2[t];
                acc[3][q] += p3[t];
                acc[4][q] += p4[t];
            }
            memcpy(rs, acc, sizeof acc);
        }
    }
    jb->dist = bits_d((uint64_t)dmax);
    jb->ulp = bits_d((uint64_t)umaxb);
    jb->beyond = beyond;
    jb->changed = changed;
}

#define CRUN(FI, FO)                                                                 \
    MULTIVERSION static void check_##FI##_##FO(MJob *jb) {                           \
        if (jb->fwork == FO)                                                         \
            check_run(jb, FI, FO, 1);                                                \
        else                                                                         \
            check_run(jb, FI, FO, 0);                                                \
    }
CRUN(0, 0) CRUN(0, 1) CRUN(0, 2) CRUN(1, 0) CRUN(1, 1) CRUN(1, 2) CRUN(2, 0) CRUN(2, 1)
CRUN(2, 2) CRUN(3, 0) CRUN(3, 1) CRUN(3, 2)
static void (*const CRUNS[4][3])(MJob *) = {{check_0_0, check_0_1, check_0_2},
                                            {check_1_0, check_1_1, check_1_2},
                                            {check_2_0, check_2_1, check_2_2},
                                            {check_3_0, check_3_1, check_3_2}};

static PyObject *check_lora(PyObject *Py_UNUSED(self), PyObject *args) {
    static const size_t ITEM[4] = {2, 2, 4, 8};
    Py_buffer w, f, bs, a;
    int fin, fout, fwork;
    Py_ssize_t cols;
    double c32, carry[NSUM];
    if (!PyArg_ParseTuple(args, "y*iy*iiny*y*d(ddddd)", &w, &fin, &f, &fout, &fwork, &cols,
                          &bs, &a, &c32, &carry[0], &carry[1], &carry[2], &carry[3],
                          &carry[4]))
        return NULL;
    PyObject *res = NULL;
    double *rowsum = NULL;
    if (fin < 0 || fin > 3 || fout < 0 || fout > 2 || fwork < 0 || fwork > 2) {
        PyErr_SetString(PyExc_ValueError, "formats: fin 0-3, fout and fwork 0-2");
        goto done;
    }
    if (cols <= 0 || f.len % (Py_ssize_t)(ITEM[fout] * (size_t)cols)) {
        PyErr_SetString(PyExc_ValueError, "f must hold whole rows of cols");
        goto done;
    }
    size_t rows = (size_t)f.len / (ITEM[fout] * (size_t)cols);
    size_t rank = (size_t)a.len / (8 * (size_t)cols);
    if (w.len != (Py_ssize_t)(ITEM[fin] * rows * (size_t)cols) ||
        a.len != (Py_ssize_t)(8 * rank * (size_t)cols) ||
        bs.len != (Py_ssize_t)(8 * rows * rank)) {
        PyErr_SetString(PyExc_ValueError, "w (rows x cols), bs (rows x r), a (r x cols) must fit");
        goto done;
    }
    rowsum = malloc((rows ? rows : 1) * NSUM * LANES * sizeof *rowsum);
    if (!rowsum) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t i = 0; i < rows * NSUM * LANES; i++) rowsum[i] = -0.0;
    MJob jb;
    memset(&jb, 0, sizeof jb);
    jb.w = w.buf;
    jb.f = f.buf;
    jb.bs = (const double *)bs.buf;
    jb.a = (const double *)a.buf;
    jb.c32 = c32;
    jb.rows = rows;
    jb.cols = (size_t)cols;
    jb.rank = rank;
    jb.fwork = fwork;
    jb.fout = fout;
    jb.rowsum = rowsum;
    Py_BEGIN_ALLOW_THREADS
    CRUNS[fin][fout](&jb);
    if (!jb.special) /* each row's lanes in order, then the rows in order */
        for (size_t i = 0; i < rows; i++)
            for (int q = 0; q < NSUM; q++) {
                const double *l = rowsum + (i * NSUM + (size_t)q) * LANES;
                double r = -0.0;
                for (int c = 0; c < LANES; c++) r += l[c];
                carry[q] += r;
            }
    Py_END_ALLOW_THREADS
    res = Py_BuildValue("iddLL(ddddd)", jb.special, jb.dist, jb.ulp, (long long)jb.beyond,
                        (long long)jb.changed, carry[0], carry[1], carry[2], carry[3],
                        carry[4]);
done:
    free(rowsum);
    PyBuffer_Release(&w);
    PyBuffer_Release(&f);
    PyBuffer_Release(&bs);
    PyBuffer_Release(&a);
    return res;
}

/* ---------------------------------------------------------------------------------
 * mlx-lm's fuse order on MLX's CPU backend: lorakit.fusion.mlx_order.
 *
 * fuse_mlx_order(w, fin, cols, bs, a, s, scale_after, promote, fout, out) -> special
 *
 *   w      C-contiguous storage bits of the weight, rows x cols of fin (0 bf16, 1 f16,
 *          2 f32).
 *   bs     float32 rows x r: fl(scale * B) for the mlx-lm order, B for scale-after.
 *   a      float32 r x cols.
 *   s      the float32 scale, multiplied after the sum when scale_after is 1.
 *   promote 0: the delta is cast to the weight's format and added in it (mlx-lm's
 *          ``weight + delta.astype(weight.dtype)``); 1: added in float32 (a fuse that
 *          forgets the cast).
 *   out    writable rows x cols of fout (0, 1, 2): the result cast to it.
 *
 * Per element the operations of MLX's CPU matmul, whose cblas_sgemm is the reference
 * BLAS in the mlx wheels for Linux: D = 0, then D = D + bs[i,k] a[k,j] for k in order,
 * float32, no FMA (-ffp-contract=off); then, as MLX computes a bf16/f16 sum (in float32,
 * rounded to the format, ties to even), the cast, the add and the cast to fout. The
 * caller checks these bits against MLX itself before it trusts them (mlx_order.py).
 * special is 1 when a value is inf or NaN: the caller computes the tensor through MLX.
 */
static ALWAYS_INLINE float f16_bits_to_f(uint32_t h) {
    const uint16_t v = (uint16_t)h;
    return (float)load_w(&v, 0, 1);
}

/* float32 -> the format's bits, ties to even (finite values; bf16 by the usual bias) */
static ALWAYS_INLINE uint32_t f_to_bits(float x, const int fmt, const Fmt *f16) {
    Pun32 p;
    p.f = x;
    if (fmt == 2) return p.u;
    if (fmt == 0) return (p.u + 0x7FFFu + ((p.u >> 16) & 1u)) >> 16;
    return (uint32_t)round_general(d_bits((double)x), f16);
}

static ALWAYS_INLINE float bits_to_f(uint32_t b, const int fmt) {
    if (fmt == 2) return bits_f32(b);
    if (fmt == 0) return bits_f32(b << 16);
    return f16_bits_to_f(b);
}

static ALWAYS_INLINE float in_fmt(float x, const int fmt, const Fmt *f16) {
    return fmt == 2 ? x : bits_to_f(f_to_bits(x, fmt, f16), fmt);
}

typedef struct {
    const void *w;
    const float *bs, *a;
    float s;
    void *out;
    size_t rows, cols, rank;
    int scale_after, promote, special;
    Fmt f16;
} OJob;

static ALWAYS_INLINE void order_run(OJob *jb, const int fin, const int fout) {
    const size_t cols = jb->cols, rank = jb->rank;
    const float s = jb->s;
    const Fmt *f16 = &jb->f16;
    float d[TILE];
    for (size_t i = 0; i < jb->rows; i++) {
        const float *b = jb->bs + i * rank;
        for (size_t j0 = 0; j0 < cols; j0 += TILE) {
            size_t m = cols - j0 < TILE ? cols - j0 : TILE;
            const size_t base = i * cols + j0;
            for (size_t t = 0; t < m; t++) d[t] = 0.0f;
            for (size_t kk = 0; kk < rank; kk++) {
                const float bk = b[kk];
                const float *ar = jb->a + kk * cols + j0;
                for (size_t t = 0; t < m; t++) d[t] = d[t] + bk * ar[t];
            }
            if (jb->scale_after)
                for (size_t t = 0; t < m; t++) d[t] = d[t] * s;
            uint32_t bad = 0;
            for (size_t t = 0; t < m; t++) {
                uint32_t wb = fin == 2 ? ((const uint32_t *)jb->w)[base + t]
                                       : ((const uint16_t *)jb->w)[base + t];
                float wv = bits_to_f(wb, fin), y;
                if (jb->promote)
                    y = wv + d[t];
                else
                    y = in_fmt(wv + in_fmt(d[t], fin, f16), fin, f16);
                uint32_t o = f_to_bits(y, fout, f16);
                Pun32 p;
                p.f = y;
                bad |= (uint32_t)((p.u & 0x7F800000u) == 0x7F800000u);
                p.f = d[t];
                bad |= (uint32_t)((p.u & 0x7F800000u) == 0x7F800000u);
                if (fout == 2)
                    ((uint32_t *)jb->out)[base + t] = o;
                else
                    ((uint16_t *)jb->out)[base + t] = (uint16_t)o;
            }
            if (bad) {
                jb->special = 1;
                return;
            }
        }
    }
}

#define ORUN(FI, FO)                                                              \
    MULTIVERSION static void order_##FI##_##FO(OJob *jb) { order_run(jb, FI, FO); }
ORUN(0, 0) ORUN(0, 1) ORUN(0, 2) ORUN(1, 0) ORUN(1, 1) ORUN(1, 2) ORUN(2, 0) ORUN(2, 1)
ORUN(2, 2)
static void (*const ORUNS[3][3])(OJob *) = {{order_0_0, order_0_1, order_0_2},
                                            {order_1_0, order_1_1, order_1_2},
                                            {order_2_0, order_2_1, order_2_2}};

static PyObject *fuse_mlx_order(PyObject *Py_UNUSED(self), PyObject *args) {
    static const size_t ITEM[3] = {2, 2, 4};
    Py_buffer w, bs, a, out;
    int fin, fout, scale_after, promote;
    Py_ssize_t cols;
    float s;
    if (!PyArg_ParseTuple(args, "y*iny*y*fiiiw*", &w, &fin, &cols, &bs, &a, &s, &scale_after,
                          &promote, &fout, &out))
        return NULL;
    PyObject *res = NULL;
    if (fin < 0 || fin > 2 || fout < 0 || fout > 2) {
        PyErr_SetString(PyExc_ValueError, "formats must be 0 (bf16), 1 (f16) or 2 (f32)");
        goto done;
    }
    if (cols <= 0 || w.len % (Py_ssize_t)(ITEM[fin] * (size_t)cols) ||
        a.len % (Py_ssize_t)(4 * (size_t)cols)) {
        PyErr_SetString(PyExc_ValueError, "w and a must hold whole rows of cols");
        goto done;
    }
    OJob jb;
    memset(&jb, 0, sizeof jb);
    jb.rows = (size_t)w.len / (ITEM[fin] * (size_t)cols);
    jb.rank = (size_t)a.len / (4 * (size_t)cols);
    if (bs.len != (Py_ssize_t)(4 * jb.rows * jb.rank) ||
        out.len != (Py_ssize_t)(ITEM[fout] * jb.rows * (size_t)cols)) {
        PyErr_SetString(PyExc_ValueError, "bs (rows x r) and out (rows x cols) must fit w and a");
        goto done;
    }
    jb.w = w.buf;
    jb.bs = (const float *)bs.buf;
    jb.a = (const float *)a.buf;
    jb.s = s;
    jb.out = out.buf;
    jb.cols = (size_t)cols;
    jb.scale_after = scale_after != 0;
    jb.promote = promote != 0;
    fmt_init(&jb.f16, 1);
    Py_BEGIN_ALLOW_THREADS
    ORUNS[fin][fout](&jb);
    Py_END_ALLOW_THREADS
    res = PyLong_FromLong(jb.special);
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&bs);
    PyBuffer_Release(&a);
    PyBuffer_Release(&out);
    return res;
}

static PyMethodDef methods[] = {
    {"fuse_nearest", fuse_nearest, METH_VARARGS,
     "fuse_nearest(w, fmt_in, cols, bs, a, row_c, col_max, g, fmt_out, out, threads)\n"
     "    -> (flagged, special)\n\n"
     "W + Bs @ A rounded once to fmt_out (0 bf16, 1 f16, 2 f32) into out; flagged holds\n"
     "the int64 flat indices to redo exactly (see lorakit/fusion/core.py)."},
    {"check_lora", check_lora, METH_VARARGS,
     "check_lora(w, fin, f, fout, fwork, cols, bs, a, c32, carry)\n"
     "    -> (special, dist, max_ulp, beyond, changed, (rd, rr, dd, qd, uu))\n\n"
     "The merge check's measure of one plain LoRA block (see lorakit/inspect/check.py)."},
    {"fuse_mlx_order", fuse_mlx_order, METH_VARARGS,
     "fuse_mlx_order(w, fmt_in, cols, bs, a, s, scale_after, promote, fmt_out, out)\n"
     "    -> special\n\n"
     "mlx-lm's fuse as MLX's CPU backend computes it (see lorakit/fusion/mlx_order.py)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fusekernel",
                                    "The correctly rounded fuse in one pass (see core.py).",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fusekernel(void) { return PyModule_Create(&module); }
