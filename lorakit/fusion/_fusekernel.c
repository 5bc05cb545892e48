/*
 * The correctly rounded LoRA fuse in one pass: lorakit.fusion._fusekernel.
 *
 * An optional accelerator for lorakit.fusion.nearest's rounding of a plain
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
 *            the terms may have cancelled (see nearest._fuse_nearest).
 *   g        gamma_n = n u / (1 - n u), the relative error bound of the f64 sum.
 *   out      writable rows x cols elements of fmt_out.
 *   flagged  bytes of int64 flat indices to redo exactly (each once, in no order).
 *   special  1 when some f64 sum is inf or NaN (a non-finite weight or adapter):
 *            the caller redoes the tensor on the numpy path, whose NaN rules it
 *            defines (``out`` is then partly written); 0 otherwise.
 *
 * The flags are those of nearest._near_ties: within 2**-20 ulp of a rounding tie (by
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
 */
#include "_kernel.h"
#ifndef _WIN32
#include <pthread.h>
#define HAVE_THREADS 1
#endif

#define TILE 512

/* nearest._tie_distance, one element: a lower bound of |x|'s distance to a tie */
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

static PyMethodDef methods[] = {
    {"fuse_nearest", fuse_nearest, METH_VARARGS,
     "fuse_nearest(w, fmt_in, cols, bs, a, row_c, col_max, g, fmt_out, out, threads)\n"
     "    -> (flagged, special)\n\n"
     "W + Bs @ A rounded once to fmt_out (0 bf16, 1 f16, 2 f32) into out; flagged holds\n"
     "the int64 flat indices to redo exactly (see lorakit/fusion/nearest.py)."},
    {NULL, NULL, 0, NULL}};

KERNEL_MODULE(_fusekernel, "The correctly rounded fuse in one pass (see nearest.py).", methods)
