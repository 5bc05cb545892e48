"""The refit of extracted factors (lorakit.algebra.refine) on its own: the rounding boxes
against the correctly rounded ``round_to_format``, and the refit on small synthetic
fuses (the embedded model's figures are in test_extract.py)."""
from __future__ import annotations

import numpy as np
import pytest

from lorakit import numerics as nm
from lorakit.algebra import refine
from lorakit.algebra.refine import outside_count, refine_factors, rounding_box


def _values(code: str) -> np.ndarray:
    """Every kind of value of a format: random normals, powers of two (the binade
    edge), the smallest normal, subnormals, zeros, both signs."""
    fmt = nm.float_format(code)
    rng = np.random.default_rng(3)
    x = rng.normal(size=400) * 10.0 ** rng.integers(-6, 3, size=400)
    pow2 = 2.0 ** np.arange(fmt.emin, 8)
    sub = fmt.min_subnormal * np.array([1, 2, 3, 7, 64])
    v = np.concatenate([x, pow2, sub, [fmt.min_normal, 0.0]])
    v = np.concatenate([v, -v[v != 0]])
    T = nm.to_float64(nm.round_to_format(v, fmt), fmt)
    return T[~((T == 0) & np.signbit(T))]  # no -0: W + B A is -0 only if both terms are


@pytest.mark.parametrize("code", ["BF16", "F16"])
def test_rounding_box_edges_are_the_exact_rounding_boundaries(code):
    T = _values(code)
    bits = nm.round_to_format(T, code)
    lo, hi, u = rounding_box(T, code)
    inward_hi, inward_lo = np.nextafter(hi, -np.inf), np.nextafter(lo, np.inf)
    outward_hi, outward_lo = np.nextafter(hi, np.inf), np.nextafter(lo, -np.inf)
    assert np.array_equal(nm.round_to_format(inward_hi, code), bits)
    assert np.array_equal(nm.round_to_format(inward_lo, code), bits)
    assert not np.any(nm.round_to_format(outward_hi, code) == bits)
    assert not np.any(nm.round_to_format(outward_lo, code) == bits)
    # on a boundary itself: ties to even (the significand's last bit of T)
    even = (bits & 1) == 0
    assert np.array_equal(nm.round_to_format(hi, code) == bits, even)
    assert np.array_equal(nm.round_to_format(lo, code) == bits, even)
    # the spacing towards zero halves at a power of two (above the smallest normal)
    edge = (np.abs(T) > nm.float_format(code).min_normal) & \
        (np.frexp(np.abs(T))[0] == 0.5)
    assert edge.sum() > 10
    below = np.where(T > 0, T - lo, hi - T)
    assert np.array_equal(below[edge], 0.25 * u[edge])
    assert np.array_equal(below[~edge], 0.5 * u[~edge])


def _fused(n: int, m: int, r: int, seed: int):
    """A bf16 base, a rank-r float32 adapter and its correctly rounded fuse, like
    lorakit.synth's (delta RMS about a twentieth of the weights')."""
    rng = np.random.default_rng(seed)
    W = nm.to_float64(nm.round_to_format(rng.normal(size=(n, m)) * 0.02, "BF16"), "BF16")
    B0 = (rng.normal(size=(n, r)) * 0.01).astype(np.float32)
    A0 = (rng.normal(size=(r, m)) * 0.035).astype(np.float32)
    delta = B0.astype(np.float64) @ A0.astype(np.float64)
    return W, delta, nm.round_to_format(W + delta, "BF16")


def _svd_factors(W, Tb, r):
    U, S, Vt = np.linalg.svd(nm.to_float64(Tb, "BF16") - W, full_matrices=False)
    root = np.sqrt(S[:r])
    return (root[:, None] * Vt[:r]).astype(np.float32), (U[:, :r] * root).astype(np.float32)


def test_refit_reproduces_a_rank_r_fuse_and_approaches_the_true_delta():
    W, delta, Tb = _fused(96, 160, 4, seed=0)
    A, B = _svd_factors(W, Tb, 4)
    res = refine_factors(W, Tb, "BF16", A, B)
    assert res.A.dtype == res.B.dtype == np.float32 and res.A.shape == A.shape
    assert res.outside_before == outside_count(W, Tb, "BF16", A, B) > 0.03 * W.size
    assert res.outside_after == outside_count(W, Tb, "BF16", res.A, res.B)
    assert res.outside_after <= 0.002 * W.size, res  # measured: a handful of elements
    # the scans count elements outside the shrunken box: at least those a re-fuse changes
    assert res.history[0] >= res.outside_before and 0 < res.iterations <= 50
    assert res.history[-1] == res.outside_after
    e = (nm.to_float64(Tb, "BF16") - W) - delta
    err = np.linalg.norm(res.B.astype(np.float64) @ res.A.astype(np.float64) - delta)
    svd_err = np.linalg.norm(B.astype(np.float64) @ A.astype(np.float64) - delta)
    assert err < 0.5 * svd_err and err <= 2 * np.linalg.norm(e)


def test_refit_never_returns_worse_factors_than_it_was_given():
    """A tuned matrix that is no rank-r fuse (a random full-rank change): no rank-4
    factors reproduce it; the refit returns the best it saw, never more outside."""
    rng = np.random.default_rng(1)
    W, _, _ = _fused(48, 64, 4, seed=1)
    Tb = nm.round_to_format(W + rng.normal(size=W.shape) * 0.01, "BF16")
    A, B = _svd_factors(W, Tb, 4)
    res = refine_factors(W, Tb, "BF16", A, B, max_iters=8)
    assert res.outside_after <= res.outside_before
    assert res.outside_after == outside_count(W, Tb, "BF16", res.A, res.B)
    assert res.outside_after > 0.5 * W.size  # nothing of rank 4 comes close


@pytest.mark.skipif(refine._kernel is None, reason="the C kernel _refitkernel is not built")
@pytest.mark.parametrize("rows, cols, r", [(64, 96, 4), (53, 301, 8), (300, 37, 3)])
def test_the_c_kernel_and_the_numpy_path_give_the_same_bits(rows, cols, r):
    """The refit with the C kernel (lorakit/algebra/_refitkernel.c) and with its numpy
    fallback: the same factors to the last bit, the same counts and history. The shapes
    reach the kernel's unrolled rank 8, a generic rank, rows longer than its block of
    256 elements and blocks that do not end on a multiple of its four chains."""
    W, _, Tb = _fused(rows, cols, r, seed=2)
    A, B = _svd_factors(W, Tb, r)
    c = refine_factors(W, Tb, "BF16", A, B, max_iters=12)
    p = refine_factors(W, Tb, "BF16", A, B, max_iters=12, use_kernel=False)
    assert c.iterations == p.iterations and c.history == p.history
    assert c.A.tobytes() == p.A.tobytes() and c.B.tobytes() == p.B.tobytes()
    assert c.outside_after < c.outside_before


@pytest.mark.parametrize("rows, cols, r", [(40, 56, 4), (13, 301, 8)])
def test_the_active_set_holds_every_element_near_or_outside_its_box(rows, cols, r):
    """A full scan's active set: every element outside the shrunken box and every one
    whose slack is below the threshold (one absolute distance for all); none other,
    with their base, edges and exponents gathered (checked against numpy). The C scan
    decides in float32 first: thresholds and boxes a float32 rounding apart from the
    float64 slack still give numpy's set. The shapes: a rank other than 8 (the kernel's
    general loop), and rank 8 (unrolled) over rows of more than one block whose length
    is no multiple of the vector's eight lanes (the one-at-a-time rest)."""
    W, _, Tb = _fused(rows, cols, r, seed=4)
    A, B = _svd_factors(W, Tb, r)
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    for use_kernel in (True, False):
        prob = refine._Problem(W, Tb, "BF16", refine.MARGIN, use_kernel)
        X = W.copy()
        for k in range(r):  # the scan's order: W, then each product in k order
            X += B64[:, k:k + 1] * A64[k]
        s = np.minimum(X - prob.lo, prob.hi - X)
        dense = int(np.median(prob.logu)) - refine.DENSE_BINADES
        thr, least = refine._thresholds(prob, refine.SLACK, dense)
        assert thr == least == refine.SLACK * 2.0 ** (dense - 1)
        # thresholds on an element's slack itself and a float32 rounding either side
        edge = np.sort(np.abs(s).reshape(-1))[::97]
        for t in [thr, *edge, *np.nextafter(edge.astype(np.float32), np.inf),
                  *np.nextafter(edge.astype(np.float32), -np.inf)]:
            act, viol = prob.scan(A64, B64, float(t))
            assert viol == int(np.count_nonzero(s < 0)) > 0
            want = np.flatnonzero(s < t)
            assert np.array_equal(act.idx, want), (use_kernel, t)
            for got, full in ((act.w, W), (act.lo, prob.lo), (act.hi, prob.hi),
                              (act.logu, prob.logu)):
                assert np.array_equal(got, np.asarray(full).reshape(-1)[want])


@pytest.mark.skipif(refine._kernel is None, reason="the C kernel _refitkernel is not built")
@pytest.mark.parametrize("r", [8, 5])
def test_the_normal_equations_are_numpy_s_at_edges_a_float32_rounding_away(r):
    """``accum`` over an active set whose box edges sit on each element's float64 sum
    rounded to float32, below and above, or one float32 step further (where the kernel's
    float32 pre-pass cannot tell inside from outside and the float64 sum decides): the
    normal equations, gradients, losses and count are numpy's, bit for bit, on both
    sides, with and without the matrices (rank 8: the vector pre-pass; 5: the general
    loop; 301 columns: blocks that do not end on a multiple of eight)."""
    W, _, Tb = _fused(29, 301, r, seed=7)
    A, B = _svd_factors(W, Tb, r)
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    X = W.copy()
    for k in range(r):
        X += B64[:, k:k + 1] * A64[k]
    x32 = X.astype(np.float32)
    rng = np.random.default_rng(3)
    pick = rng.integers(0, 6, size=X.shape)
    probs = [refine._Problem(W, Tb, "BF16", refine.MARGIN, k) for k in (True, False)]
    for prob in probs:
        lo, hi = prob.lo, prob.hi
        up, down = np.nextafter(x32, np.float32(np.inf)), np.nextafter(x32, np.float32(-np.inf))
        # an edge on the element's own sum rounded to float32, or one step beyond it,
        # below or above (the other edge moved out where it would cross)
        for q, edge in ((0, x32), (2, up)):
            lo[pick == q] = edge[pick == q]
            hi[pick == q] = np.maximum(hi, up)[pick == q]
        for q, edge in ((1, x32), (3, down)):
            hi[pick == q] = edge[pick == q]
            lo[pick == q] = np.minimum(lo, down)[pick == q]
        assert (prob.lo <= prob.hi).all()
    acts = [prob.scan(A64, B64, 1e9)[0] for prob in probs]
    assert acts[0].idx.size == X.size
    wtab = probs[0].weights(1.0)
    for side in (0, 1):
        for full in (True, False):
            c, p = (prob.accum(act, A64, B64, wtab, side, full)
                    for prob, act in zip(probs, acts))
            assert c[3] == p[3] > 0
            for got, want in zip(c[:3], p[:3]):
                assert got.tobytes() == want.tobytes(), (side, full)


@pytest.mark.skipif(refine._kernel is None, reason="the C kernel _refitkernel is not built")
@pytest.mark.parametrize("code", ["BF16", "F16"])
def test_the_c_boxes_are_rounding_box_s(code):
    """The kernel's boxes from the stored bits (``box``) against numpy's
    ``rounding_box``: every kind of value (zeros of both signs, subnormals, powers of
    two, the largest finite) at the refit's margins and the exact boundaries; a
    non-finite value sends the module to numpy."""
    fmt = nm.float_format(code)
    T = _values(code)
    T = np.concatenate([T, [-0.0, fmt.max_value, -fmt.max_value]])
    bits = nm.round_to_format(T, code).reshape(1, -1)
    W = np.zeros(bits.shape, np.float32)
    for margin in (0.5, refine.MARGIN, 0.5 - 2.0 ** -12):
        c = refine._Problem(W, bits, code, margin, True)
        p = refine._Problem(W, bits, code, margin, False)
        for name in ("lo", "hi", "logu"):
            assert getattr(c, name).tobytes() == getattr(p, name).tobytes(), (margin, name)
    bad = np.concatenate([bits, nm.round_to_format(np.array([[np.inf]]), code)], axis=1)
    lo = np.empty(bad.shape, np.float32)
    assert refine._kernel.box(bad, refine._BOX_FORMATS[code], 0.5, lo, lo.copy(),
                              np.empty(bad.shape, np.int16)) == 1
    c = refine._Problem(np.zeros(bad.shape, np.float32), bad, code, 0.5, True)
    p = refine._Problem(np.zeros(bad.shape, np.float32), bad, code, 0.5, False)
    assert c.lo[:, :-1].tobytes() == p.lo[:, :-1].tobytes() and np.isinf(c.hi[0, -1])


@pytest.mark.skipif(refine._kernel is None, reason="the C kernel _refitkernel is not built")
@pytest.mark.parametrize("code", ["BF16", "F16"])
def test_the_c_stats_pass_counts_as_numpy_rounds(code):
    """``fuse_stats``: the kernel's count of re-fused elements that differ (one rounding
    of the float64 sum to nearest, ties to even, overflow, signed zeros, subnormals) is
    numpy's ``round_to_format``'s, and the residual agrees to the last bits of another
    order of addition; ``difference``: ``T - W`` exact, its norm and the noise the
    same. Ties: tuned values moved by one ulp put sums on boundaries."""
    fmt = nm.float_format(code)
    rng = np.random.default_rng(11)
    n, m = 48, 300
    mag = 10.0 ** rng.integers(-9 if code == "BF16" else -7, 4, size=(n, m))
    W = nm.to_float32(nm.round_to_format(rng.normal(size=(n, m)) * mag, fmt), fmt)
    W[0, :6], W[1, :6] = 0.0, -0.0
    W[2, :4] = fmt.max_value
    A = (rng.normal(size=(3, m)) * 10.0 ** rng.integers(-5, 2, size=(3, m))).astype(np.float32)
    B = (rng.normal(size=(n, 3)) * 10.0 ** rng.integers(-5, 2, size=(n, 3))).astype(np.float32)
    A[:, :3] = 0
    A[:, 3] = 2.0 ** rng.integers(-8, 0, size=3)  # products on the spacing of W: ties
    exact = nm.round_to_format(W + B.astype(np.float64) @ A, fmt)
    moved = exact.copy()
    moved[::3] ^= np.uint16(1)
    moved[4, :6] ^= np.uint16(0x8000)
    for Tb in (exact, moved):
        for fac in ((A, B), (A * 0, B * 0)):
            c = refine.fuse_stats(W, Tb, code, *fac, use_kernel=True)
            p = refine.fuse_stats(W, Tb, code, *fac, use_kernel=False)
            assert c[0] == p[0], (c, p)
            assert c[1] == pytest.approx(p[1], rel=1e-12)
        dc, dp = np.full(W.shape, np.nan), np.full(W.shape, np.nan)
        c = refine.difference(W, Tb, code, dc, use_kernel=True)
        p = refine.difference(W, Tb, code, dp, use_kernel=False)
        assert c == pytest.approx(p, rel=1e-12)
        assert dc.tobytes() == dp.tobytes()  # T - W, exact
        assert np.array_equal(dc, nm.to_float64(Tb, fmt) - W)
        half = 0.5 * nm.ulp(nm.to_float64(Tb, fmt), fmt)
        assert c[1] == pytest.approx(float(np.sum(half * half)), rel=1e-12)
    assert refine.fuse_stats(W, moved, code, A, B)[0] > n * m / 3
    assert refine.outside_count(W, moved, code, A, B) == \
        refine.fuse_stats(W, moved, code, A, B, use_kernel=False)[0]


def test_a_narrow_active_band_reaches_what_the_wide_one_does():
    """The default band (SLACK, narrow: a smaller active set built again more often)
    and the 0.125-ulp band of COUNT_SLACK leave about as many elements outside, both
    far below the SVD's, and each count is a real full pass's."""
    W, _, Tb = _fused(96, 160, 4, seed=5)
    A, B = _svd_factors(W, Tb, 4)
    assert refine.SLACK < refine.COUNT_SLACK
    narrow = refine_factors(W, Tb, "BF16", A, B)
    wide = refine_factors(W, Tb, "BF16", A, B, slack=refine.COUNT_SLACK)
    for res in (narrow, wide):
        assert res.outside_after == outside_count(W, Tb, "BF16", res.A, res.B)
        assert res.outside_after < 0.1 * res.outside_before
    assert abs(narrow.outside_after - wide.outside_after) <= 0.2 * wide.outside_after + 5


def test_the_median_exponent_is_numpys_median():
    """``_Problem.median_logu`` (a histogram, a row chunk at a time) is
    ``int(np.median(logu))``, also for an even count (the mean of the middle two,
    truncated towards zero) and for rows longer than a chunk."""
    rng = np.random.default_rng(3)
    for shape in [(1, 1), (2, 1), (3, 5), (64, 33), (7, 300_001)]:
        for k in range(6):
            lu = rng.integers(-140, 5, size=shape).astype(np.int16)
            if k % 3 == 0:
                lu[...] = rng.integers(-3, -1, size=shape)
            prob = object.__new__(refine._Problem)
            prob.logu, prob.shape = lu, shape
            assert prob.median_logu() == int(np.median(lu)), (shape, k)


@pytest.mark.skipif(refine._kernel is None, reason="the C kernel _refitkernel is not built")
@pytest.mark.parametrize("k", [1, 3, 8])
def test_the_damped_steps_are_cholesky_s_in_c_and_numpy(k):
    """``_solve``: the kernel's Cholesky and its numpy twin give the same bits, the
    solution of ``(G + mu tr(G)/k I) d = g`` (against ``np.linalg.solve``); a zero
    matrix is damped by the identity, and a system with a pivot that is not positive
    gets a zero step in both."""
    rng = np.random.default_rng(k)
    F = rng.normal(size=(200, 40, k)) * 10.0 ** rng.integers(-4, 3, size=(200, 1, 1))
    G = np.einsum("nia,nib->nab", F, F)
    G[0] = 0.0
    G[1] = -5 * np.eye(k)
    g = rng.normal(size=(200, k))
    mu = 10.0 ** rng.uniform(-6, 2, size=200)
    c = refine._solve(G.reshape(200, -1), g, mu, True)
    p = refine._solve(G.reshape(200, -1), g, mu, False)
    assert c.tobytes() == p.tobytes()
    tr = np.trace(G, axis1=1, axis2=2) / k
    damp = np.where(tr > 0, mu * tr, 1.0)
    want = np.linalg.solve(G + damp[:, None, None] * np.eye(k), g[..., None])[..., 0]
    assert np.allclose(c[2:], want[2:], rtol=1e-9, atol=0)
    assert np.array_equal(c[0], g[0]) and not np.any(c[1])
