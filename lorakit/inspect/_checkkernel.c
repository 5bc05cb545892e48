/*
 * The merge check's measure of a plain LoRA block in one pass: lorakit.inspect._checkkernel,
 * an optional accelerator for check.py whose numpy twin, check._lora_numpy, gives the
 * same numbers (tests/inspect/test_check_kernel.py): per element exactly its operations
 * (no FMA, -ffp-contract=off, every sum in one fixed order). special is 1 when a value is
 * inf or NaN or X rounds to inf: the caller then measures the block on the numpy path.
 * Tiles of TILE columns across all rows, each row's sums carried from tile to tile.
 */
#include "_kernel.h"

#define TILE 512


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

/* the bits of ulp(x): signed compares (the fields are below 2**63), as AVX2 has them */
static ALWAYS_INLINE uint64_t ulp_bits(double x, uint64_t lo, uint64_t hi, uint64_t msh) {
    int64_t e = (int64_t)(d_bits(x) & 0x7FF0000000000000ull);
    e = e < (int64_t)lo ? (int64_t)lo : e;
    e = e > (int64_t)hi ? (int64_t)hi : e;
    return (uint64_t)e - msh;
}

static ALWAYS_INLINE double ulp_c(double x, uint64_t lo, uint64_t hi, uint64_t msh) {
    return bits_d(ulp_bits(x, lo, hi, msh));
}

/* 1 / ulp_c(x): the power of two with the negated exponent (2046 - E for 2**(E - 1023)) */
static ALWAYS_INLINE double inv_ulp(double x, uint64_t lo, uint64_t hi, uint64_t msh) {
    return bits_d((2046ull << 52) - ulp_bits(x, lo, hi, msh));
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
    double prod[NSUM][TILE]; /* the five products summed along each row */
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
                prod[0][t] = R * Dm;
                prod[1][t] = R * R;
                prod[2][t] = Dm * Dm;
                prod[3][t] = Q * Dm;
                prod[4][t] = u * u;
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
                        prod[3][t] = (q - W) * (X - W);
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
                for (int q = 0; q < LANES; q++)
                    for (int c = 0; c < NSUM; c++) acc[c][q] += prod[c][t + q];
            for (; t < m; t++)
                for (int c = 0; c < NSUM; c++) acc[c][t % LANES] += prod[c][t];
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
    MJob jb = {.w = w.buf, .f = f.buf, .bs = (const double *)bs.buf, .a = (const double *)a.buf,
               .c32 = c32, .rows = rows, .cols = (size_t)cols, .rank = rank, .fwork = fwork,
               .fout = fout, .rowsum = rowsum};
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

static PyMethodDef methods[] = {
    {"check_lora", check_lora, METH_VARARGS,
     "check_lora(w, fin, f, fout, fwork, cols, bs, a, c32, carry)\n"
     "    -> (special, dist, max_ulp, beyond, changed, (rd, rr, dd, qd, uu))\n\n"
     "The merge check's measure of one plain LoRA block (see lorakit/inspect/check.py)."},
    {NULL, NULL, 0, NULL}};

KERNEL_MODULE(_checkkernel, "The merge check's pass over a plain LoRA (see check.py).", methods)
