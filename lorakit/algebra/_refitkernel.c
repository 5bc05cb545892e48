/*
 * The refit's sparse passes in C: lorakit.algebra._refitkernel.
 *
 * An optional accelerator for lorakit.algebra.refine (its numpy fallback gives the
 * same bits: both compute x = W + sum_k B[i,k] At[j,k] in float64 term by term in k
 * order, and add each element's contributions to its row's / column's sums in
 * element order, the order np.bincount uses; tests/algebra/test_refine.py compares
 * the two bit for bit).
 *
 * scan(w, lo, hi, logu, cols, r, b, at, thr) -> (active, violators)
 *   One full pass over a module: w, lo, hi float32 rows x cols (the base and the
 *   shrunken box edges), logu int16 (exponent of each ulp), b float64 rows x r, at
 *   float64 cols x r, thr float64[1024]: an element is active when its slack to the
 *   nearer box edge is below thr[logu + 512] (negative outside the box).
 *   active: bytes of int64 flat indices, ascending; violators: elements outside.
 *
 * accum(idx, w, lo, hi, logu, cols, r, b, at, wtab, side, G, g, loss) -> violators
 *   Over the gathered active set (idx int64, w/lo/hi float32, logu int16 of those
 *   elements): for each element outside its box, residual rr (signed distance
 *   outside) and weight wt = wtab[logu + 512], with s its row (side 0, f = at[j]) or
 *   column (side 1, f = b[i]): loss[s] += (wt*rr)*rr and, when G is non-empty,
 *   G[s, pair(a<=b)] += (f_a*f_b)*wt, g[s, k] += (wt*rr)*f_k.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* Four elements' x = w + sum_k b[k] a[k] at once: four independent chains of additions
   (each in k order, as dotx), so the CPU overlaps them instead of waiting on one. */
#define DOT4_BODY(R)                                                              \
    for (Py_ssize_t k = 0; k < (R); k++) {                                        \
        x0 += b0[k] * a0[k]; x1 += b1[k] * a1[k];                                 \
        x2 += b2[k] * a2[k]; x3 += b3[k] * a3[k];                                 \
    }
static inline void dot4(double *x, const double *b0, const double *b1, const double *b2,
                        const double *b3, const double *a0, const double *a1,
                        const double *a2, const double *a3, Py_ssize_t r) {
    double x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
    if (r == 8) { DOT4_BODY(8) } else { DOT4_BODY(r) }
    x[0] = x0; x[1] = x1; x[2] = x2; x[3] = x3;
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

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer w, lo, hi, lu, b, at, thr;
    Py_ssize_t cols, r;
    if (!PyArg_ParseTuple(args, "y*y*y*y*nny*y*y*", &w, &lo, &hi, &lu, &cols, &r, &b, &at, &thr))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = w.len / 4;
    if (cols <= 0 || r <= 0 || n % cols || lo.len != w.len || hi.len != w.len ||
        lu.len != n * 2 || b.len != (n / cols) * r * 8 || at.len != cols * r * 8 ||
        thr.len != TAB * 8) {
        PyErr_SetString(PyExc_ValueError, "_refitkernel.scan: buffer sizes do not match");
        goto done;
    }
    const float *W = w.buf, *L = lo.buf, *H = hi.buf;
    const int16_t *U = lu.buf;
    const double *Bp = b.buf, *Ap = at.buf, *Th = thr.buf;
    Py_ssize_t cap = n / 8 + cols + 1024, cnt = 0, viol = 0;
    int64_t *out = malloc(cap * sizeof(int64_t));
    if (!out) { PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t rows = n / cols;
    double xs[BLK];
    for (Py_ssize_t i = 0; i < rows && out; i++) {
        if (cnt + cols > cap) {  /* room for a whole row: the appends below need no check */
            cap = 2 * cap > cnt + cols ? 2 * cap : cnt + cols;
            int64_t *nw = realloc(out, cap * sizeof(int64_t));
            if (!nw) { free(out); out = NULL; break; }
            out = nw;
        }
        const double *bi = Bp + i * r;
        for (Py_ssize_t j0 = 0; j0 < cols; j0 += BLK) {
            Py_ssize_t nb = cols - j0 < BLK ? cols - j0 : BLK, t0 = i * cols + j0, u = 0;
            for (; u < nb; u++) xs[u] = (double)W[t0 + u];
            for (u = 0; u + 4 <= nb; u += 4) {
                const double *a = Ap + (j0 + u) * r;
                dot4(xs + u, bi, bi, bi, bi, a, a + r, a + 2 * r, a + 3 * r, r);
            }
            for (; u < nb; u++) xs[u] = dotx(xs[u], bi, Ap + (j0 + u) * r, r);
            for (u = 0; u < nb; u++) {  /* no branch: the appends are unconditional stores */
                Py_ssize_t t = t0 + u;
                double x = xs[u];
                double s1 = x - (double)L[t], s2 = (double)H[t] - x;
                double s = s1 < s2 ? s1 : s2;
                int e = U[t] + OFF;
                double th = Th[e < 0 ? 0 : (e >= TAB ? TAB - 1 : e)];
                viol += s < 0;
                out[cnt] = t;
                cnt += s < th;
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (!out) { PyErr_NoMemory(); goto done; }
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)out, cnt * sizeof(int64_t));
    free(out);
    if (bytes) res = Py_BuildValue("Nn", bytes, viol);
done:
    PyBuffer_Release(&w); PyBuffer_Release(&lo); PyBuffer_Release(&hi); PyBuffer_Release(&lu);
    PyBuffer_Release(&b); PyBuffer_Release(&at); PyBuffer_Release(&thr);
    return res;
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
    Py_ssize_t size = side ? cols : rows, np_ = r * (r + 1) / 2;
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
    Py_BEGIN_ALLOW_THREADS
    /* A block of elements at a time, in three steps: the row and column of each flat
       index (one division per row met: the active set is ascending); x of all of them,
       four at a time (dot4); then, in element order as before, the sums of those
       outside their box. The same additions in the same order as one element at a
       time, so the same bits. */
    Py_ssize_t i = 0, row0 = 0;
    Py_ssize_t bi_[BLK], bj_[BLK];
    double xs[BLK], rs[BLK];
    int vs[BLK];
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
            xs[u] = (double)W[t0 + u];
        }
        if (bad) break;
        for (u = 0; u + 4 <= nb; u += 4)
            dot4(xs + u, Bp + bi_[u] * r, Bp + bi_[u + 1] * r, Bp + bi_[u + 2] * r,
                 Bp + bi_[u + 3] * r, Ap + bj_[u] * r, Ap + bj_[u + 1] * r,
                 Ap + bj_[u + 2] * r, Ap + bj_[u + 3] * r, r);
        for (; u < nb; u++) xs[u] = dotx(xs[u], Bp + bi_[u] * r, Ap + bj_[u] * r, r);
        Py_ssize_t nv = 0;
        for (u = 0; u < nb; u++) {  /* those outside, listed without a branch */
            double x = xs[u], h = (double)H[t0 + u], l = (double)L[t0 + u];
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
                Py_ssize_t q = 0;
                for (Py_ssize_t a = 0; a < r; a++) {
                    gs[a] += wr * f[a];
                    for (Py_ssize_t c = a; c < r; c++) Gs[q++] += (f[a] * f[c]) * wv;
                }
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) PyErr_SetString(PyExc_ValueError, "_refitkernel.accum: index out of range");
    else res = PyLong_FromSsize_t(viol);
done:
    PyBuffer_Release(&ix); PyBuffer_Release(&w); PyBuffer_Release(&lo); PyBuffer_Release(&hi);
    PyBuffer_Release(&lu); PyBuffer_Release(&b); PyBuffer_Release(&at); PyBuffer_Release(&wt);
    PyBuffer_Release(&G); PyBuffer_Release(&g); PyBuffer_Release(&loss);
    return res;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "active set of a full pass (see the file's header)"},
    {"accum", accum, METH_VARARGS, "normal equations over the active set"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_refitkernel",
                                    "the refit's sparse passes", -1, methods};

PyMODINIT_FUNC PyInit__refitkernel(void) { return PyModule_Create(&module); }
