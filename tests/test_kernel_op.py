"""``_lib/kernel_op``: the declarative support check (shape symbols, expressions, rules, dtypes, alignment)
every kernel's ``is_supported`` is, and the ``KernelOp`` shell (verdict once per signature, fallback
counted with its reason and copied into the caller's buffers, launch counted), on a CPU."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath._lib import counters, kernel_op
from k3_fastpath._lib.dispatch import OK
from k3_fastpath._lib.kernel_op import Arg, KernelOp, Rule, TensorSpec, evaluate

BF = torch.bfloat16
DEVICE_REASONS = ("cutlass-dsl unavailable", "no cuda device")


def bf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(BF)


def test_expressions_are_a_small_closed_language():
    names = {"H": 4, "D": 128, "HEAD_DIMS": (32, 64, 128), "fmt": "mxfp4"}
    assert evaluate("H*D", names) == 512 and evaluate("D in HEAD_DIMS", names)
    assert evaluate("1 <= H <= 8 and D % 32 == 0", names) and not evaluate("not H", names)
    assert evaluate("fmt in ('mxfp4', 'bf16')", names)
    assert evaluate("H >= 8 and 128 % (H // 8) == 0", {"H": 4}) is False  # short-circuits before a zero divisor
    for bad in ("__import__('os')", "H.real", "[H]", "H ** 2"):
        with pytest.raises(ValueError):
            evaluate(bad, names)
    with pytest.raises(KeyError):
        evaluate("Q + 1", names)


def test_shape_symbols_bind_then_every_use_is_checked():
    from k3_fastpath.kernels.situ_glu.api import SUPPORT

    assert SUPPORT.check({"g": bf(4, 16), "u": bf(4, 8)}).reason == "u shape [4, 8] (needs [M, I] = [4, 16])"
    assert SUPPORT.check({"g": bf(2, 4, 16), "u": bf(4, 16)}).reason == "g is 3-d (needs [M, I])"
    assert SUPPORT.check({"g": bf(4, 12), "u": bf(4, 12)}).reason == "I=12 not a multiple of 8"
    assert SUPPORT.check({"g": bf(0, 16), "u": bf(0, 16)}).reason == "M=0"
    assert SUPPORT.check({"g": bf(4, 16)}).reason == "u missing"
    assert SUPPORT.check({"g": bf(4, 16), "u": bf(4, 16)}).reason in DEVICE_REASONS  # the envelope holds here
    f32 = torch.randn(4, 16)
    assert SUPPORT.dims({"g": f32, "u": f32}) == ({"M": 4, "I": 16}, OK)


def test_expressions_constants_requires_and_dtype_forms():
    from k3_fastpath.kernels.kda_decode.api import SUPPORT as KDA
    from k3_fastpath.kernels.mla_decode.api import DECODE_OP
    from k3_fastpath.kernels.rmsnorm_residual.api import SUPPORT as NORM
    from k3_fastpath.kernels.skinny_gemm.api import SUPPORT as GEMM

    x = bf(3, 64)
    assert NORM.check({"x": x, "weight": bf(64), "residual_out": bf(3, 64)}).reason == "residual_out without residual"
    B, N, H, D = 3, 5, 2, 32
    C = H * D
    kda = {"state": torch.randn(N, H, D, D), **{n: bf(B, C) for n in "qkvga"}, "beta_logits": bf(B, H),
           **{n: torch.randn(C, 4) for n in ("conv_q_w", "conv_k_w", "conv_v_w")}, "A_log": torch.randn(H),
           "dt_bias": torch.randn(C), "o_norm_w": torch.randn(D), "slot": torch.arange(B, dtype=torch.int32),
           "slot_out": torch.arange(B, dtype=torch.int32), **{n: bf(N, 3, C) for n in ("conv_q", "conv_k", "conv_v")}}
    assert KDA.check(kda).reason in DEVICE_REASONS
    dims, s = KDA.dims({**kda, "conv_q": bf(N, 3, 60)})
    assert dims == {"N": 5, "H": 2, "D": 32, "B": 3, "NA": 2} and s.reason == (
        "conv_q shape [5, 3, 60] (needs [N, CONV_W-1, H*D] = [5, 3, 64])")
    assert KDA.check({**kda, "state": torch.randn(N, H, D, 16)}).reason.startswith("state shape [5, 2, 32, 16]")
    assert KDA.check({**kda, "A_log": torch.randn(1)}).reason == "A_log needs >= H entries"
    assert KDA.check(kda, {"T": 2}).reason.startswith("q shape [3, 64] (needs [B*T, H*D] = [6, 64])")  # a verify step
    cache = torch.randn(4, 64, 576).to(torch.float16)
    ops = {"q_lat": bf(2, 8, 512), "q_pe": bf(2, 8, 64), "cache": cache,
           "block_table": torch.zeros(2, 4, dtype=torch.int32), "ctx_len": torch.ones(2, dtype=torch.int32),
           "w_uv": bf(8, 128, 512)}
    assert DECODE_OP.spec.check(ops).reason == "cache dtype float16 (needs bfloat16 or float8_e4m3fn)"
    ops["cache"] = cache.to(BF)
    assert DECODE_OP.spec.check(ops).reason in DEVICE_REASONS
    w = bf(16, 64)
    out = torch.empty(3, 16, dtype=torch.float16)
    assert GEMM.check({"x": x, "w": w, "out": out}, {"out_dtype": torch.float16}).reason == "out dtype torch.float16"
    got = GEMM.check({"x": x, "w": w, "out": out}, {"out_dtype": torch.float32})
    assert got.reason == "out dtype float16 (needs float32)" or got.reason in DEVICE_REASONS


def test_a_spec_names_each_operand_once():
    with pytest.raises(ValueError, match="named twice"):
        TensorSpec(Arg("x", ("M",)), Arg("x", ("M",)))


def _toy(monkeypatch) -> tuple[KernelOp, list[int]]:
    spec = TensorSpec(Arg("x", ("M", "H")), Arg("out", ("M", "H"), optional=True),
                      rules=(Rule("H % 8 == 0", "H={H} not a multiple of 8"),), dtype=BF)
    op = KernelOp("toy_kernel", spec)
    calls = [0]
    decide = op._decide

    def counted(tensors, scalars):
        calls[0] += 1
        return decide(tensors, scalars)
    monkeypatch.setattr(op, "_decide", counted)
    return op, calls


def test_the_verdict_is_decided_once_per_signature(monkeypatch):
    op, calls = _toy(monkeypatch)
    x = bf(4, 12)
    for _ in range(3):
        assert op.support({"x": x, "out": None}).reason == "H=12 not a multiple of 8"
    assert calls[0] == 1
    op.support({"x": bf(4, 12), "out": None})  # another tensor, the same signature
    assert calls[0] == 1
    op.support({"x": bf(5, 12), "out": None})  # another shape: another decision
    op.support({"x": bf(4, 12).t().contiguous().t(), "out": None})  # same shape, not contiguous
    assert calls[0] == 3 and len(op.decisions()) == 3


def test_a_refused_call_runs_the_reference_into_the_callers_buffers_and_counts_why(monkeypatch):
    op, _ = _toy(monkeypatch)
    counters.reset()
    x = bf(4, 12)
    out = torch.full((4, 12), float("nan"), dtype=BF)  # poisoned: the fallback must overwrite it
    launched = []
    got = op({"x": x, "out": out}, launch=lambda: launched.append(1), reference=lambda: x * 2, outputs=(out,))
    assert got is out and torch.equal(out, x * 2) and not launched
    assert counters.snapshot()["fallbacks"] == {"toy_kernel": {"H=12 not a multiple of 8": 1}}
    assert counters.launches("toy_kernel") == 0


def test_a_served_call_launches_once_and_counts_it(monkeypatch):
    op, _ = _toy(monkeypatch)
    monkeypatch.setattr(kernel_op, "check_tensors", lambda *a, **k: OK)  # stand in for an H200's verdict
    counters.reset()
    x = bf(4, 16)
    got = op({"x": x, "out": None}, launch=lambda: x + 1, reference=lambda: pytest.fail("reference called"))
    assert torch.equal(got, x + 1) and counters.launches("toy_kernel") == 1 and counters.fallbacks() == 0


def test_a_tuple_result_fills_only_the_buffers_given(monkeypatch):
    op, _ = _toy(monkeypatch)
    x = bf(4, 12)
    buf = torch.zeros(4, 12, dtype=BF)
    a, b = op({"x": x, "out": None}, launch=lambda: None, reference=lambda: (x + 1, None), outputs=(buf, None))
    assert a is buf and torch.equal(buf, x + 1) and b is None


def test_every_kernel_api_declares_its_envelope_with_a_kernel_op():
    """Every kernel folder's api states its support through ``_lib.kernel_op`` (no hand-written fallback
    block or counter call left in an api)."""
    from pathlib import Path

    from k3_fastpath.kernels import KERNELS

    root = Path(__file__).resolve().parents[1] / "k3_fastpath" / "kernels"
    for name in KERNELS:
        src = (root / name / "api.py").read_text()
        assert "KernelOp(" in src, name
        assert "count_fallback" not in src and "count_launch" not in src, name


def test_strided_rows_accept_padded_pages_only(monkeypatch):
    """An operand declared ``strided_rows`` (the kernel takes its dim-0 stride: vLLM's padded or interleaved
    cache pages) passes the contiguity check as its first index when each index is contiguous and the stride
    keeps the alignment; anything else reaches the check as it is and is refused as not contiguous."""
    seen = {}

    def check(tensors, dtype, align=16):
        seen.update(tensors)
        return OK
    monkeypatch.setattr(kernel_op, "check_tensors", check)
    spec = TensorSpec(Arg("pool", ("N", "W", "C"), strided_rows=True), Arg("x", ("N2", "C")), dtype=BF)
    buf = torch.randn(6, 5, 16).to(BF)
    padded = buf[:, :3]  # 5 rows apart, 3 used: 5 * 16 * 2 bytes between indices
    assert not padded.is_contiguous()
    assert spec.check_devices({"pool": padded, "x": bf(2, 16)})
    assert seen["pool"].is_contiguous() and seen["pool"].shape == (1, 3, 16)
    assert seen["pool"].data_ptr() == padded.data_ptr()
    assert kernel_op.rows_view(buf) is buf  # contiguous: itself
    odd = torch.randn(6, 3 * 16 + 1).to(BF)[:, :48].view(6, 3, 16)  # stride 49 elements: 98 bytes, not 16-aligned
    assert kernel_op.rows_view(odd) is odd
    inner_strided = buf.transpose(1, 2)  # an index is not contiguous itself
    assert kernel_op.rows_view(inner_strided) is inner_strided
