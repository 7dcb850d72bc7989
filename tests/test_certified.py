"""The certified forward (csrc/cuda/forward_plan.h's use_certified: on sm_90a the default from
kCertifiedMinBatch = 513 rows, 257 with a prepared weight, and with one also from 33 rows to one
row per SM, on weights large enough (see the tests of the switch below);
FUSED_POOL_GELU_CERTIFIED=1 forces it wherever it applies):
a single-pass GEMM on scaled fp16 copies of the rows with a proven error bound, then float32
rescoring of the columns that may still hold each row's maximum.

Each test runs the forward with the path forced on and checks the answer against float64 (the same
check as every other forward test), on data built to stress the bound: ties, near-ties, huge and
tiny magnitudes, subnormals, non-finite rows, long K; `_certified_candidate_counts` reports how
many columns each row sent to the rescoring (-1: all of them).
"""

import os

import pytest
import torch

import fused_pool_gelu

pytestmark = pytest.mark.cuda
DEVICE = "cuda"
_OPS = torch.ops.fused_pool_gelu


def _certified_can_run():
    """An sm_90a build on a compute capability 9.0 GPU (the path needs wgmma). Decided from the
    build and the device, not by asking the path: a regression of where it applies must fail
    these tests, not skip them."""
    archs = fused_pool_gelu.build_info().get("cuda_archs", "")
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and "9.0a" in archs
    )


@pytest.fixture
def certified(set_debug_knobs):
    """Forces the certified path; skips where it cannot run."""
    if not _certified_can_run():
        pytest.skip("the certified path needs an sm_90a build on a compute capability 9.0 GPU")
    set_debug_knobs(FUSED_POOL_GELU_CERTIFIED="1")


@pytest.fixture
def certified_call(certified, kernels_run):
    """call(x, weight, bias, scale, prepared=None): forward_with_argmax on the forced certified
    path, asserting that the certified kernels served it (kernels_run): pass 1, then the fused
    selection and rescoring for at most one row per SM (certified_fused_rows) or the selection and
    rescoring kernels beyond, the weight's copy made in the call only without a prepared one, and
    no 3xTF32 GEMM. Without this a forward that ignored FUSED_POOL_GELU_CERTIFIED would pass every
    accuracy test here on the 3xTF32 path. Under scripts/sanitize.sh (FUSED_POOL_GELU_SANITIZER
    set), whose compute-sanitizer leaves CUPTI no way to attach, the call runs without the
    profiler and its kernels are not asserted: there the memory checks are the point."""
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    under_sanitizer = bool(os.environ.get("FUSED_POOL_GELU_SANITIZER"))

    def call(x, weight, bias, scale, prepared=None):
        if under_sanitizer:
            return _OPS.forward_with_argmax(x, weight, bias, scale, prepared)
        outputs = []
        names = kernels_run(
            lambda: outputs.append(_OPS.forward_with_argmax(x, weight, bias, scale, prepared))
        )

        def ran(kernel):
            # "::" keeps rescore_kernel from matching select_rescore_kernel.
            return any(f"::{kernel}" in name for name in names)

        fused = x.shape[0] <= sms
        assert ran("certified_pass1_kernel"), names
        assert ran("select_rescore_kernel") == fused, names
        assert ran("select_candidates_kernel") != fused, names
        assert ran("rescore_kernel") != fused, names
        assert ran("prepare_rows_kernel") == (prepared is None), names
        assert not any("tf32x3" in name for name in names), names
        return outputs[0]

    return call


@pytest.fixture
def run_certified(certified_call, deterministic_algorithms):
    """run(x, weight, bias, scale) on the forced certified path (certified_call: its kernels
    asserted): the forward's outputs and the candidate counts. It also checks that the forward
    with the weight's prepared copy (prepare_weight, made once) gives the same bits as without it
    (the copy made inside the call). In deterministic mode, whose NaN-filled allocations keep the
    second call from finding the first one's values in its workspace. Every row's count is
    checked to be a count: 1 to kMaxCandidates (64), or -1 (rescored whole); an unwritten one
    reads as NaN's bits."""

    def run(x, weight, bias, scale):
        out, argmax, preactivation = certified_call(x, weight, bias, scale)
        prepared = _OPS.prepare_weight(weight)
        for a, b in zip(certified_call(x, weight, bias, scale, prepared),
                        (out, argmax, preactivation)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        counts = _OPS._certified_candidate_counts(x, weight, bias, scale)
        assert counts.shape == (x.shape[0],)
        assert bool((((counts >= 1) & (counts <= 64)) | (counts == -1)).all()), counts
        return out, argmax, preactivation, counts

    return run


def _relative_error(ours, ref):
    return float((ours.double() - ref).norm() / ref.norm())


def _check_each_row_at_its_own_scale(ref, out, argmax, preactivation, x, weight, bias, scale):
    """check_forward's absolute tolerance (1e-5) is above every value of a row of magnitude 1e-6 or
    less: the output, the chosen column's value and the pre-activation held to 1e-5 of the row's
    largest |value| and |z| instead."""
    z64 = ref.preactivation(x, weight, bias)
    v64 = ref.values(x, weight, bias, scale)
    best64 = v64.amax(dim=1)
    row_values = v64.abs().amax(dim=1)
    assert bool(((out.double() - best64).abs() <= 1e-5 * row_values).all())
    chosen = v64.gather(1, argmax[:, None]).squeeze(1)
    assert bool(((chosen - best64).abs() <= 1e-5 * row_values).all())
    z_chosen = z64.gather(1, argmax[:, None]).squeeze(1)
    assert bool(((preactivation.double() - z_chosen).abs() <= 1e-5 * z64.abs().amax(dim=1)).all())


# Default shape, odd sizes (B > 32: the tensor-core range), K = 65536, the widest layer the
# selection serves (N = 4096, 16 n tiles), 9 m tiles. Batches of at most one row per SM (132 on the
# H200) take pass 1's 128-wide tiles and the fused selection and rescoring (up to 32 splits), larger
# ones the 256-wide tiles and the two kernels (up to 8); pass 1's splits on the H200
# (forward_plan.h's plan_certified), in order: 8, 1, 1, 5, 32, 2, 1, 5, 7, 10, 12, 2, 4, 4, 3.
# So the fused kernel runs at every split bound (1, 2, 4, 8, 16, 32) and the selection kernel at
# 1, 2, 4 and 8, with and without loads past the last split (load_split_partials).
SHAPES = [
    (1024, 8192, 512),
    (33, 4, 1),
    (100, 257, 3),
    (1000, 4099, 513),
    (40, 65536, 64),
    (300, 1000, 4096),
    (1100, 96, 260),
    (41, 1540, 67),
    (45, 2100, 70),
    (50, 3200, 33),
    (37, 3700, 129),
    (60, 600, 20),
    (70, 1100, 50),
    (200, 2000, 40),
    (150, 1700, 300),
]


@pytest.mark.parametrize("batch,in_features,pooled", SHAPES, ids=str)
@pytest.mark.parametrize("scale", [2.0, -0.5])
def test_certified_forward_matches_float64(
    batch, in_features, pooled, scale, run_certified, make_inputs, check_forward, ref
):
    x, weight, bias = make_inputs(batch, in_features, pooled, torch.float32, DEVICE)
    out, argmax, preactivation, counts = run_certified(x, weight, bias, scale)
    check_forward(out, argmax, preactivation, x, weight, bias, scale)
    v64 = ref.values(x, weight, bias, scale).max(dim=1).values
    assert _relative_error(out, v64) <= 1e-6
    if (batch, in_features, pooled) == (1024, 8192, 512) and scale == 2.0:
        # research/simulate_certified.py on data like this: 1.4 candidates per row on average,
        # 99.9% of rows at most 5 (TF32 operands: 1.7; fp16 with the worst-case operand bound
        # r(v) <= 2^-11 |v| instead of the rows' residual norms: more than twice the bound; a mean
        # above 2.5 means the norms are not in use or the copies lost precision).
        assert float(counts.float().mean()) <= 2.5, counts.float().mean()
        assert int((counts == -1).sum()) <= 2


@pytest.mark.parametrize("in_features,pooled", [(8192, 512), (3000, 37)], ids=str)
def test_fused_rows_give_the_bits_of_the_two_kernel_path(
    in_features, pooled, certified_call, make_inputs, deterministic_algorithms
):
    # One row more than the SMs takes the 256-wide pass 1 and the two kernels, one row per SM the
    # 128-wide pass 1 and the fused kernel (certified_fused_rows; certified_call asserts which):
    # other splits, other pass-1 sums and other candidates, but each row's rescoring is the same
    # float32 arithmetic, so every output must be the same bits.
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    x, weight, bias = make_inputs(sms + 1, in_features, pooled, torch.float32, DEVICE)
    two_kernels = certified_call(x, weight, bias, 2.0)
    fused = certified_call(x[:sms], weight, bias, 2.0)
    for a, b in zip(fused, two_kernels):
        torch.testing.assert_close(a, b[:sms], rtol=0, atol=0, equal_nan=True)


def test_certified_forward_is_bitwise_deterministic(
    certified_call, make_inputs, deterministic_algorithms
):
    x, weight, bias = make_inputs(1024, 8192, 512, torch.float32, DEVICE)
    first = certified_call(x, weight, bias, 2.0)
    for _ in range(3):
        again = _OPS.forward_with_argmax(x, weight, bias, 2.0)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


# 64 rows: the fused kernel, whose two rescoring groups split a row's candidate list; 256: the
# selection and rescoring kernels.
@pytest.mark.parametrize("batch", [64, 256])
def test_exact_ties_take_the_first_column(batch, run_certified, make_inputs, check_forward):
    x, weight, bias = make_inputs(batch, 1024, 64, torch.float32, DEVICE)
    # Columns 5, 17 and 40 identical and dominant: every row ties between them.
    weight[17] = weight[5]
    weight[40] = weight[5]
    bias[17] = bias[40] = bias[5] = bias.abs().max() + 10
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert bool((argmax == 5).all())
    # The three copies lead every other column by ~10, far beyond the bound: exactly they remain.
    assert bool((counts == 3).all()), counts


def test_near_ties_the_bound_cannot_separate(run_certified, make_inputs, check_forward):
    x, weight, bias = make_inputs(256, 1024, 64, torch.float32, DEVICE)
    x = x.abs() + 0.5  # positive x: a larger weight means a larger z
    weight[9] = weight[3]
    # z9 - z3 = x[:, 100] 2^-14 >= 3e-5: some 30 float32 ulps of z (~10), which the float32
    # rescoring resolves, but far inside pass 1's bound (~1e-3 here: the fp16 copies' residuals).
    weight[9, 100] = weight[3, 100] + 2**-14
    bias[3] = bias[9] = bias.abs().max() + 10
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    # Both stay candidates and the rescoring decides: column 9 in every row.
    assert bool(((counts >= 2) | (counts == -1)).all()), counts
    assert bool((argmax == 9).all())


# Pass 1's three tiles and both selections: 64 rows take the 64 x 128 tile and the fused kernel,
# 128 the 128 x 128 tile and the fused kernel, 256 the 128 x 256 tile and the selection and
# rescoring kernels (each split at least twice at these shapes on the H200).
PASS1_TILE_BATCHES = [64, 128, 256]


@pytest.mark.parametrize("batch", PASS1_TILE_BATCHES)
@pytest.mark.parametrize("lossy", ["both", "x", "weight"])
def test_fp16_rounding_reverses_the_order_and_the_rescoring_restores_it(
    lossy, batch, run_certified, check_forward
):
    # v = 1 + 2^-11 - 2^-23 sits just below the midpoint between 1 and 1 + 2^-10: its fp16 copy
    # (scaled by 2^14 with its row, which scales the midpoint too) rounds down to 1 with the
    # largest residual rounding to nearest leaves; 1.0 loses nothing. The lossy operands hold v:
    # both, or only x or only the weight, whose residual norm is then all the bound has to cover
    # the loss with. Column 0 meets x = +v (its z underestimated by m (p - q), p = xv wv exact,
    # q = 1 in fp16), column 1 meets x = -v (its negative z overestimated by as much), and column
    # 1's bias leaves it delta = m (p - q) behind column 0 in exact arithmetic, delta ahead in
    # pass 1. Both must stay candidates and column 0 must win.
    m = 512
    v = 1 + 2**-11 - 2**-23
    xv = v if lossy in ("both", "x") else 1.0
    wv = v if lossy in ("both", "weight") else 1.0
    x = torch.tensor([xv] * m + [-xv] * m, device=DEVICE).expand(batch, 2 * m).contiguous()
    weight = torch.zeros(8, 2 * m, device=DEVICE)
    weight[0, :m] = wv
    weight[1, m:] = wv
    bias = torch.full((8,), -100.0, device=DEVICE)
    bias[0] = 0.0
    p = xv * wv
    bias[1] = 2 * m * p - m * (p - 1)
    # The premise, in float64 from the float32 inputs: exact order 0 > 1, rounded order 1 > 0.
    b1 = float(bias[1])
    assert m * p > -m * p + b1 and m * 1.0 < -m * 1.0 + b1
    assert float(torch.tensor(v).half()) == 1.0
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert bool((argmax == 0).all())
    assert bool((counts == 2).all())


@pytest.mark.parametrize("batch", PASS1_TILE_BATCHES)
def test_split_partials_that_cancel(batch, run_certified, check_forward):
    # Pass 1 stores its split partials in bfloat16 (8 significant bits): here two of them are ~128
    # and cancel to z < 1, so their rounding (up to 0.5 each) dwarfs every other error. x is 1 on
    # K's first and last 64-wide tiles (0 elsewhere), the weights +2 on the first and -2 on the
    # last: pass 1 splits K in whole tiles and, for one output tile at K = 8192, into several (8
    # to 32 on the H200 at these batches), so whatever the split count the first split's partial
    # is 128 and the last one's -128. The first also carries column A's 0.4375 (128.4375 rounds
    # down to 128) or column B's 0.53125 (128.53125 rounds up to 129). Every value is exact in fp16
    # once scaled, so pass 1 loses nothing else: B's z~ = 1 - 0.25 exceeds A's 0 by far more than
    # the bound's other terms (~0.04: the accumulation's g ||x|| ||w||, g ~ 1.5e-4), while A's
    # exact z = 0.4375 beats B's 0.28125. Without the storage's term (~1 here) the selection would
    # drop A.
    in_features, pooled = 8192, 8
    column_a, column_b = 2, 5
    x = torch.zeros(batch, in_features, device=DEVICE)
    x[:, :64] = 1.0
    x[:, -64:] = 1.0
    weight = torch.zeros(pooled, in_features, device=DEVICE)
    weight[:, :64] = 2.0
    weight[:, -64:] = -2.0
    weight[column_a, 0] += 0.4375
    weight[column_b, 0] += 0.53125
    bias = torch.full((pooled,), -100.0, device=DEVICE)
    bias[column_a] = 0.0
    bias[column_b] = -0.25
    # The premise: bfloat16 reverses the two columns' order.
    assert float(torch.tensor(128 + 0.4375).bfloat16()) == 128.0
    assert float(torch.tensor(128 + 0.53125).bfloat16()) == 129.0
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert bool((argmax == column_a).all())
    assert bool(((counts >= 2) | (counts == -1)).all())


def test_all_columns_equal_rescore_the_whole_row(run_certified, make_inputs, check_forward):
    x, weight, bias = make_inputs(64, 512, 96, torch.float32, DEVICE)
    weight[:] = weight[0]
    bias[:] = bias[0]
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert bool((counts == -1).all())  # 96 candidates > 64: every column is rescored
    assert bool((argmax == 0).all())


@pytest.mark.parametrize("scale", [2.0, -0.5])
def test_negative_preactivations(scale, run_certified, make_inputs, check_forward, ref):
    # z from about -0.5 down to -12: around gelu's minimum (x0 = -0.75) gelu is not monotone, and
    # far below 0 it climbs back to -0 (float32 gives exactly -0.0 below ~-5.4: ties), so with
    # scale > 0 a row's largest value sits at its most negative z, with scale < 0 near x0.
    x, weight, bias = make_inputs(256, 1024, 96, torch.float32, DEVICE)
    bias = -torch.linspace(0.5, 12.0, 96, device=DEVICE)
    out, argmax, preactivation, counts = run_certified(x, weight, bias, scale)
    check_forward(out, argmax, preactivation, x, weight, bias, scale)
    if scale > 0:
        # Rows with no positive z: their maximum is -0.0, tied over every column whose z is below
        # ~-5.45 (float32's 1 + erf(z / sqrt 2) is 0 there), and check_forward's tolerance accepts
        # any of them. torch.max's rule takes the first: at or before the first column surely
        # there (z < -5.6), and a column of that tie (z < -5.3; above, gelu(z) is below -0.0).
        z64 = ref.preactivation(x, weight, bias)
        rows = (z64.amax(dim=1) < 0) & (z64 < -5.6).any(dim=1)
        assert int(rows.sum()) > 50
        first_sure = (z64 < -5.6).int().argmax(dim=1)
        assert bool((out[rows] == 0).all())
        assert bool((argmax[rows] <= first_sure[rows]).all())
        assert bool((z64.gather(1, argmax[:, None]).squeeze(1)[rows] < -5.3).all())


@pytest.mark.parametrize("magnitude", [1e-30, 1e-18, 1e18, 1e25])
def test_huge_and_tiny_magnitudes(magnitude, run_certified, make_inputs, check_forward, ref):
    x, weight, bias = make_inputs(128, 2048, 96, torch.float32, DEVICE)
    x = x * magnitude
    bias = bias * magnitude * 1e-3
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    _check_each_row_at_its_own_scale(ref, out, argmax, preactivation, x, weight, bias, 2.0)
    if magnitude == 1e25:
        # Above 2^77 even the largest scale, 2^-63, leaves x's rows beyond fp16's range: their
        # copies overflow and every row is rescored whole (kMaxScaleExponent).
        assert bool((counts == -1).all())
    elif magnitude != 1e-30:
        # Each row's scale brings it into fp16's range: selected like data of magnitude 1.
        stats = (int((counts == -1).sum()), float(counts[counts >= 0].float().mean()))
        assert bool((counts != -1).all()), stats
        assert float(counts.float().mean()) <= 4, stats
    # At 1e-30 the scale exponent stops at 63 (certified.cuh, kMaxScaleExponent): the
    # scaled rows fall below fp16's normal range, their copies are zero, their residuals are the
    # rows themselves, and the bound lets most columns through (rescored whole, still exact).


@pytest.mark.parametrize("magnitude", [1e2, 1e4, 1e6])
def test_large_preactivations_select_few_columns(
    magnitude, run_certified, make_inputs, check_forward
):
    # |z| up to ~magnitude: the interval's upper end must not grow with z. The selection bounds
    # gelu's slope by 1/2 + 2 phi(0) max(b, 0), capped at gelu's largest slope (1.129); without the
    # cap the upper end moved by ~0.8 b (b - a) and let most positive columns through.
    x, weight, bias = make_inputs(128, 2048, 96, torch.float32, DEVICE)
    x = x * magnitude
    bias = bias * magnitude
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    stats = (int((counts == -1).sum()), float(counts[counts >= 0].float().mean()))
    assert bool((counts != -1).all()), stats
    assert float(counts.float().mean()) <= 4, stats


def test_subnormal_inputs(run_certified, make_inputs, check_forward):
    x, weight, bias = make_inputs(128, 2048, 96, torch.float32, DEVICE)
    x[:, ::2] *= 1e-40  # half of every row subnormal: below 2^-14 once scaled, zero in the copy
    weight[:, 1::3] *= 1e-41
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)


def test_rows_all_subnormal(run_certified, make_inputs, check_forward, ref):
    # Rows of x and of the weight whose every element is subnormal (x ~1e-39, the weight's ~1e-39
    # too). Even scaled by the largest power of two (2^63, kMaxScaleExponent) their squares are
    # subnormal in float32, so the norms lean on the floor per term (kNormSquaresFloorPerTerm) and
    # the copies are zero: those rows are bounded by their residuals alone. Their z are themselves
    # subnormal, below check_forward's absolute tolerance: held instead to what float32's FMAs
    # (-ftz=false) can be held to, each rounding at most half the subnormal spacing 2^-149, so
    # |z - z64| <= K 2^-150 and |out - out64| <= |scale| (|z - z64| + 2^-150) / 2 + 2^-150
    # (gelu(z) = z / 2 + O(z^2) there), both within K 2^-149 |scale|.
    batch, in_features, pooled, scale = 128, 2048, 96, 2.0
    x, weight, _ = make_inputs(batch, in_features, pooled, torch.float32, DEVICE)
    tiny_rows, tiny_columns = [0, 3, 64, 127], [0, 50, 95]
    x[tiny_rows] *= 1e-39
    weight[tiny_columns] *= 4e-38
    assert float(x[tiny_rows].abs().max()) < 2.0**-126
    assert float(weight[tiny_columns].abs().max()) < 2.0**-126
    out, argmax, preactivation, _ = run_certified(x, weight, None, scale)
    check_forward(out, argmax, preactivation, x, weight, None, scale)
    tol = in_features * 2.0**-149 * abs(scale)
    rows = torch.tensor(tiny_rows, device=DEVICE)
    z64 = ref.preactivation(x, weight, None)[rows]
    v64 = ref.values(x, weight, None, scale)[rows]
    best64 = v64.amax(dim=1)
    assert bool((best64 > 0).all()) and bool((best64 < 2.0**-126).all())  # subnormal answers
    assert bool(((out[rows].double() - best64).abs() <= tol).all())
    # The chosen column is a maximizer within the two roundings of z that may have swapped it.
    chosen = v64.gather(1, argmax[rows, None]).squeeze(1)
    assert bool(((best64 - chosen) <= 2 * tol).all())
    z_chosen = z64.gather(1, argmax[rows, None]).squeeze(1)
    assert bool(((preactivation[rows].double() - z_chosen).abs() <= tol).all())


def test_zero_rows_and_rows_wider_than_fp16(run_certified, make_inputs, check_forward):
    # A zero row (scale exponent 0, norms 0), and rows whose magnitudes span far more than the
    # 2^29 an fp16 copy holds below its largest element: the small part is flushed to zero in the
    # copy and left to the residual norm.
    x, weight, bias = make_inputs(128, 2048, 96, torch.float32, DEVICE)
    x[5] = 0
    weight[7] = 0
    x[9, ::7] *= 1e20
    weight[11, ::5] *= 1e-12
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)


# One row per SM or fewer (the fused kernel) and more (the selection and rescoring kernels): both
# read each row's per-split norm sums through x_row_norms.
@pytest.mark.parametrize("batch,in_features", [(96, 8192), (300, 4096)], ids=str)
def test_rows_and_splits_of_different_magnitudes_keep_their_own_bounds(
    batch, in_features, run_certified, make_inputs, check_forward, ref
):
    # Rows 2^-24 .. 2^24 apart, and within each row K's second half 2^-16, 1 or 2^16 times the
    # first (so the splits of a row carry different scale exponents): each row's bound must come
    # from its own splits' sums. Scaled by powers of two, every row selects like data of magnitude
    # 1 (test_huge_and_tiny_magnitudes); a row handed another row's sums would get a bound up to
    # 2^48 too wide (every column rescored: count -1) or too narrow (a wrong arg-max). No bias,
    # which would dominate the smallest rows' z and hide the latter.
    x, weight, _ = make_inputs(batch, in_features, 512, torch.float32, DEVICE)
    bias = None
    rows = torch.arange(batch, device=DEVICE)
    row_exponent = (rows % 5 - 2) * 12
    half_exponent = ((rows % 3) - 1) * 16
    x = x * torch.exp2(row_exponent.float())[:, None]
    x[:, in_features // 2:] *= torch.exp2(half_exponent.float())[:, None]
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    _check_each_row_at_its_own_scale(ref, out, argmax, preactivation, x, weight, bias, 2.0)
    stats = (int((counts == -1).sum()), float(counts[counts >= 0].float().mean()))
    assert bool((counts != -1).all()), stats
    assert float(counts.float().mean()) <= 4, stats


# The whole-row rescoring takes a row's columns kGroup = 4 at a time, then what is left: 96 rows
# take the fused kernel, whose two rescoring groups take every other column (80, 83, 86 columns:
# 0 and 0, 2 and 1, 3 and 3 left), 200 rows rescore_kernel (0, 3 and 2 left).
@pytest.mark.parametrize("batch", [96, 200])
@pytest.mark.parametrize("pooled", [80, 83, 86])
def test_rows_with_inf_or_nan(batch, pooled, run_certified, make_inputs, check_forward):
    x, weight, bias = make_inputs(batch, 1024, pooled, torch.float32, DEVICE)
    x[3, 7] = float("inf")
    x[10, 0] = float("nan")
    x[11, 5] = -float("inf")
    # Every other row meets its only NaN z in the last column: its answer (that column, NaN) is
    # found only if the last group is rescored.
    weight[pooled - 1, 9] = float("nan")
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert bool((counts == -1).all())
    others = torch.ones(batch, dtype=torch.bool, device=DEVICE)
    others[[3, 10, 11]] = False
    assert bool((argmax[others] == pooled - 1).all())
    assert bool(out[others].isnan().all())


def test_rows_of_every_candidate_count_interleaved(run_certified, make_inputs, check_forward):
    # The rescoring takes the rows in the selection's order (rows with 2+ candidates and whole
    # rows first: kRescoreHeavyCandidates in certified.cuh), not in row order: rows with
    # one, several and every column as candidates, interleaved at random, each get their own
    # answer. Columns 7, 20 and 33 are copies that only feature 0 separates from the rest: rows
    # with a large x[:, 0] tie between them (3+ candidates), the others select as usual, and rows
    # with a NaN are rescored whole.
    batch, in_features, pooled = 777, 1024, 64
    x, weight, bias = make_inputs(batch, in_features, pooled, torch.float32, DEVICE)
    weight[:, 0] = 0
    weight[20] = weight[7]
    weight[33] = weight[7]
    weight[[7, 20, 33], 0] = 1.0
    bias[20] = bias[33] = bias[7]  # exact ties: the first column, 7, wins
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    kind = torch.randint(0, 5, (batch,), device=DEVICE, generator=gen)
    tied = kind == 0
    whole = kind == 1
    x[:, 0] = torch.where(tied, 50.0, 0.0)
    x[whole, 3] = float("nan")
    out, argmax, preactivation, counts = run_certified(x, weight, bias, 2.0)
    check_forward(out, argmax, preactivation, x, weight, bias, 2.0)
    assert bool((argmax[tied] == 7).all())
    assert bool((counts[tied] >= 3).all())
    assert bool((counts[whole] == -1).all())
    light = ~tied & ~whole
    assert bool((counts[light] >= 1).all())
    assert int((counts[light] == 1).sum()) > 0


# kCertifiedMinBatch = 513 without a prepared weight, kCertifiedPreparedMinBatch = 257 with one,
# for weights of N >= 512 rows (kCertifiedMinColumns) and N x K >= 2^21 floats
# (kCertifiedMinWeightFloats; K padded to a multiple of 4), or of N >= 256 rows and N x K >= 2^19
# floats once B x N x K reaches 2^31 (kCertifiedMinWork).
@pytest.mark.parametrize(
    "prepared,batch,pooled,in_features,takes_certified",
    [
        (False, 512, 512, 4096, False),
        (False, 513, 512, 4096, True),
        (True, 256, 512, 4096, False),
        (True, 257, 512, 4096, True),
        (True, 1024, 2048, 1024, True),
        (False, 1024, 512, 4092, False),  # 4 x 512 floats short of 2^21, work short of 2^31
        (True, 1024, 512, 2048, False),  # work 2^30
        (False, 2048, 512, 2048, True),  # work 2^31
        (False, 1023, 256, 8192, False),
        (False, 1024, 256, 8192, True),
        (True, 4096, 512, 1024, True),
        (True, 8192, 512, 512, False),  # 2^18 floats: too small at any work
        (True, 4096, 128, 4096, False),  # too narrow at any work
    ],
)
def test_the_default_takes_the_certified_path_from_its_batch_and_weight_size(
    prepared, batch, pooled, in_features, takes_certified, certified, set_debug_knobs
):
    _check_default_path(prepared, batch, pooled, in_features, takes_certified, set_debug_knobs)


# With a prepared weight, also from kCertifiedFusedMinBatch = 33 rows to one row per SM (the fused
# rows: certified_fused_rows), for weights of N >= 512 rows and N x K >= 2^22 floats
# (kCertifiedFusedMinWeightFloats); never without one below 513 rows.
@pytest.mark.parametrize(
    "pooled,in_features,large_enough",
    [(512, 8192, True), (1024, 4096, True), (512, 8188, False), (256, 16384, False)],
)
@pytest.mark.parametrize("rows", ["33", "SMs", "SMs + 1"])
@pytest.mark.parametrize("prepared", [True, False])
def test_the_default_takes_the_fused_rows_with_a_prepared_weight(
    rows, prepared, pooled, in_features, large_enough, certified, set_debug_knobs
):
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    batch = {"33": 33, "SMs": sms, "SMs + 1": sms + 1}[rows]
    takes_certified = prepared and large_enough and batch <= sms
    _check_default_path(prepared, batch, pooled, in_features, takes_certified, set_debug_knobs)


def _check_default_path(prepared, batch, pooled, in_features, takes_certified, set_debug_knobs):
    x = torch.rand(batch, in_features, device=DEVICE)
    weight = torch.randn(pooled, in_features, device=DEVICE) * 0.02
    bias = torch.randn(pooled, device=DEVICE)
    prepared_weight = _OPS.prepare_weight(weight) if prepared else None
    forced = _OPS.forward_with_argmax(x, weight, bias, 2.0)  # the fixture forces it on
    set_debug_knobs(FUSED_POOL_GELU_CERTIFIED="0")
    off = _OPS.forward_with_argmax(x, weight, bias, 2.0, prepared_weight)
    set_debug_knobs(FUSED_POOL_GELU_CERTIFIED=None)
    default = _OPS.forward_with_argmax(x, weight, bias, 2.0, prepared_weight)
    # The two paths round differently (float32 dot products in another order): some output
    # differs in its last bits, and the default matches exactly one of them bitwise.
    assert not all(torch.equal(a, b) for a, b in zip(forced, off))
    expected = forced if takes_certified else off
    for a, b in zip(default, expected):
        assert torch.equal(a, b)
