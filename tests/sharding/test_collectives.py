"""smp_collectives on its own: kernels (Triton under TRITON_INTERPRET=1 vs torch, bitwise),
quantisation error bounds, error feedback, ring / quantized collectives on gloo at 2 and 4 ranks.

Tolerances: Triton vs torch and ring vs the process group on integer-valued inputs are exact
(torch.equal). Quantised results are checked against the analytic per-element bound of
`smp_collectives.error_bound` (int8: absmax/254 per block; fp8: 2**-4 relative + 2**-10 of the
scale), summed over senders, plus 1e-6 relative for the fp32 accumulation.
"""

from __future__ import annotations

import pytest
import torch

import smp_collectives as sc
from smp_collectives import quantization as Q
from tests.sharding import collective_cases as cases

triton_kernels = pytest.importorskip("smp_collectives.triton_kernels")


def _wide_range(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gradient-like data: magnitudes over 8 decades, a zero block, a negative zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 2, cols)[torch.randperm(cols, generator=g)]
    x[0, :64] = 0.0
    x[-1, -1] = -0.0
    return x


# ------------------------------------------------------------------------------------------
# Kernels: Triton (interpreted on CPU) vs the torch path, bitwise


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("rows,cols,block", [(4, 1000, 64), (2, 512, 256), (3, 37, 16)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_quantize_equals_torch(kind, rows, cols, block, with_residual):
    x = _wide_range(rows, cols, seed=rows * cols)
    res_t = torch.randn(rows, cols) * 1e-3 if with_residual else None
    res_k = res_t.clone() if with_residual else None
    q_t, s_t = Q.quantize_torch(x, block, kind, res_t)
    q_k, s_k = triton_kernels.quantize(x, block, kind, res_k)
    assert torch.equal(q_t, q_k) and torch.equal(s_t, s_k)
    if with_residual:
        assert torch.equal(res_t, res_k)
        assert res_t.abs().sum() > 0  # the residual really was updated
    acc_t = Q.dequantize_accumulate_torch(q_t, s_t, block, kind, divisor=3.0)
    acc_k = triton_kernels.dequantize_accumulate(q_t, s_t, block, kind, divisor=3.0)
    assert torch.equal(acc_t, acc_k)
    assert torch.equal(Q.dequantize_torch(q_t, s_t, block, kind), triton_kernels.dequantize(q_t, s_t, block, kind))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_triton_bf16_input_equals_torch(kind):
    x = _wide_range(2, 300, seed=5).to(torch.bfloat16)
    q_t, s_t = Q.quantize_torch(x, 64, kind)
    q_k, s_k = triton_kernels.quantize(x, 64, kind)
    assert torch.equal(q_t, q_k) and torch.equal(s_t, s_k)


def _scale_one(values: torch.Tensor, qmax: float, block: int = 256) -> torch.Tensor:
    """Blocks whose absmax is exactly QMAX, so the scale is 1.0 and codes = round(values)."""
    per = block - 1
    n = -(-values.numel() // per)
    padded = torch.zeros(n * per)
    padded[: values.numel()] = values
    return torch.cat([torch.full((n, 1), qmax), padded.view(n, per)], dim=1).reshape(1, -1)


def test_int8_rounding_is_nearest_even():
    ties = torch.arange(-126, 127, dtype=torch.float32) + 0.5
    x = _scale_one(torch.cat([ties, ties + 0.25, ties - 0.26]), 127.0)
    q_t, s_t = Q.quantize_torch(x, 256, "int8")
    q_k, _ = triton_kernels.quantize(x, 256, "int8")
    assert torch.equal(s_t, torch.ones_like(s_t))
    assert torch.equal(q_t, q_k)
    # The sweep can tell round-half-even from truncation (what the interpreter's cast does).
    assert not torch.equal(q_t.view(torch.int8), x.trunc().to(torch.int8))


def test_fp8_rounding_matches_torch_cast_on_every_tie():
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties between neighbours, subnormals included
    quarter = grid[:-1] + (grid[1:] - grid[:-1]) / 4
    values = torch.cat([grid, mids, quarter, -grid, -mids, -quarter])
    x = _scale_one(values, 448.0)
    q_t, _ = Q.quantize_torch(x, 256, "fp8")  # torch's own float8_e4m3fn cast
    q_k, _ = triton_kernels.quantize(x, 256, "fp8")
    assert torch.equal(q_t, q_k)
    # Ties go both ways (to the even neighbour), so a truncating encoder could not pass.
    decoded = Q.dequantize_torch(q_t, torch.ones(1, q_t.shape[1] // 256), 256, "fp8")[0]
    at = {float(v): float(d) for v, d in zip(x[0], decoded)}
    assert any(at[float(m)] == float(hi) for m, hi in zip(mids, grid[1:]))
    assert any(at[float(m)] == float(lo) for m, lo in zip(mids, grid[:-1]))


def test_fp8_decode_every_code():
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8).view(1, -1)  # all but the two NaNs
    scale = torch.full((1, codes.shape[1] // 16 + 1), 0.75)
    assert torch.equal(Q.dequantize_torch(codes, scale, 16, "fp8"), triton_kernels.dequantize(codes, scale, 16, "fp8"))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_torch_path_spans_do_not_change_results(kind, monkeypatch):
    """The CPU path works through a bucket in column spans (cache-sized); with spans forced to
    a few blocks (ending mid-row, a short last block), every result still equals Triton's."""
    monkeypatch.setattr(Q, "_SPAN_ELEMENTS", 64 * 3)
    monkeypatch.setattr(Q, "_MIN_SPAN_COLS", 16)
    assert len(list(Q._spans(4, 1000, 64))) > 3
    x = _wide_range(4, 1000, seed=3)
    res_t = torch.randn(4, 1000) * 1e-3
    res_k = res_t.clone()
    out = torch.full((4, 1100), 7, dtype=torch.uint8)[:, :1000]  # rows strided, like a message buffer
    q_t, s_t = Q.quantize_torch(x, 64, kind, res_t, out=out)
    q_k, s_k = triton_kernels.quantize(x, 64, kind, res_k)
    assert q_t.data_ptr() == out.data_ptr()
    assert torch.equal(q_t, q_k) and torch.equal(s_t, s_k) and torch.equal(res_t, res_k)
    acc = torch.full((1000,), float("nan"))
    Q.dequantize_accumulate_torch(q_k, s_k, 64, kind, divisor=3.0, out=acc)
    assert torch.equal(acc, triton_kernels.dequantize_accumulate(q_k, s_k, 64, kind, divisor=3.0))
    assert torch.equal(Q.dequantize_torch(q_k, s_k, 64, kind), triton_kernels.dequantize(q_k, s_k, 64, kind))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_torch_path_workspace_reuse_leaves_no_trace(kind):
    """The CPU path reuses one scratch buffer across calls: a call on a large bucket full of
    NaN/inf must not change the result of a later, smaller call with short last blocks."""
    x = _wide_range(3, 37, seed=11)
    res = torch.randn(3, 37) * 1e-3
    before = Q.quantize_torch(x, 16, kind, res.clone()), Q.dequantize_accumulate_torch(*Q.quantize_torch(x, 16, kind), 16, kind)
    junk = torch.full((5, 4096), float("nan"))
    junk[:, ::2] = float("inf")
    Q.quantize_torch(junk, 256, kind, torch.zeros_like(junk))
    Q.dequantize_accumulate_torch(*Q.quantize_torch(junk, 256, kind), 256, kind)
    res_after = res.clone()
    (q1, s1), acc1 = before
    q2, s2 = Q.quantize_torch(x, 16, kind, res_after)
    acc2 = Q.dequantize_accumulate_torch(*Q.quantize_torch(x, 16, kind), 16, kind)
    assert torch.equal(q1, q2) and torch.equal(s1, s2) and torch.equal(acc1, acc2)
    assert torch.isfinite(res_after).all() and torch.isfinite(acc2).all()


# ------------------------------------------------------------------------------------------
# Error bounds and error feedback


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("block", [16, 256])
def test_quantization_error_within_analytic_bound(kind, block):
    x = _wide_range(3, 2000, seed=11)
    q, s = sc.quantize(x, block, kind, impl="torch")
    err = (sc.dequantize(q, s, block, kind, impl="torch") - x).abs()
    bound = sc.error_bound(x, s, block, kind)
    assert (err <= bound).all()
    assert (err > 0).any() and float((err / bound.clamp_min(1e-38)).max()) > 0.3  # bound is tight-ish
    # Per block, relative to its own absmax: int8 <= 1/254 everywhere.
    if kind == "int8":
        rel = err.view(3, -1) / s.repeat_interleave(block, 1)[:, :2000].clamp_min(1e-38) / 127
        assert float(rel.max()) <= 1 / 254 + 1e-7


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_error_feedback_telescopes(kind):
    """sum_t dequant_t == sum_t grad_t + residual_0 - residual_T; without feedback the lost
    mass grows with the number of steps."""
    g = torch.Generator().manual_seed(3)
    steps, shape, block = 30, (2, 500), 64
    residual = torch.zeros(shape)
    sent, truth, sent_plain = (torch.zeros(shape, dtype=torch.float64) for _ in range(3))
    for _ in range(steps):
        grad = torch.randn(shape, generator=g) * 1e-2 + 3e-3  # a bias quantisation keeps dropping
        q, s = sc.quantize(grad, block, kind, residual, impl="torch")
        sent += sc.dequantize(q, s, block, kind, impl="torch").double()
        qp, sp = sc.quantize(grad, block, kind, impl="torch")
        sent_plain += sc.dequantize(qp, sp, block, kind, impl="torch").double()
        truth += grad.double()
    telescoped = (sent - (truth - residual.double())).abs().max()
    assert telescoped < 1e-6, telescoped
    assert residual.abs().max() <= (truth.abs().max())  # bounded, does not accumulate
    lost_with, lost_without = float((sent - truth).abs().max()), float((sent_plain - truth).abs().max())
    assert lost_without > 3 * lost_with, (lost_with, lost_without)


# ------------------------------------------------------------------------------------------
# Collectives on gloo


@pytest.mark.parametrize("world,split", [(2, False), (4, False), (4, True)], ids=["w2", "w4", "w4-subgroups"])
def test_ring_bitwise_equals_default_and_bytes_bound(ranks, world, split):
    for r in ranks(world).run(cases.ring_vs_default, split=split):
        assert r["rs_equal_sum"] and r["rs_equal_avg"] and r["ag_equal"] and r["ar_equal"], r
        n, size = r["n"], r["size_bytes"]
        assert r["rs_bytes_sum"] == (n - 1) * size // n  # (N-1)/N x S, exactly
        assert r["ag_bytes"] == (n - 1) * size // n


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_reduce_scatter_error_and_bytes(ranks, world, kind):
    for r in ranks(world).run(cases.quantized_reduce_scatter_case, kind=kind, block=256, cols=512, impl="torch"):
        assert r["within_bound"], r["max_err_over_bound"]
        assert r["max_err"] > 0  # really quantised
        assert r["bytes"] == r["expected_bytes"]
        assert r["bytes"] <= 0.27 * r["fp32_bytes"], (r["bytes"], r["fp32_bytes"])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_reduce_scatter_triton_equals_torch(ranks, kind):
    pool = ranks(2)
    torch_out = pool.run(cases.quantized_reduce_scatter_case, kind=kind, block=64, cols=300, impl="torch")
    triton_out = pool.run(cases.quantized_reduce_scatter_case, kind=kind, block=64, cols=300, impl="triton")
    for a, b in zip(torch_out, triton_out):
        assert torch.equal(a["result"], b["result"])


@pytest.mark.parametrize("kind", [None, "int8", "fp8"])
def test_cross_replica_hook_leaves_replicas_identical(ranks, kind):
    outs = ranks(4).run(cases.cross_replica_hook_case, kind=kind)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    if kind is None:  # uncompressed ring: the exact mean up to fp32 summation order
        g = [torch.randn(1000, generator=torch.Generator().manual_seed(3000 + r)) for r in range(4)]
        assert torch.allclose(outs[0], torch.stack(g).mean(0), atol=1e-6)
