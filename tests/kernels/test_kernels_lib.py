"""CPU tests of the kernel machinery: counters, fallbacks with reasons, compile-cache key and capture
guard, torch->CuTe conversion. No GPU; the cutlass-dsl parts skip with a reason when it is absent."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from k3_fastpath._lib import arch, compile_cache, counters
from k3_fastpath.kernels.attn_res_mix import attn_res_mix, attn_res_mix_ref
from k3_fastpath.kernels.rmsnorm_residual import RMSNormConfig, rmsnorm_residual, rmsnorm_residual_ref
from k3_fastpath.kernels.skinny_gemm import SkinnyGemmConfig, skinny_gemm, skinny_gemm_ref
from k3_fastpath.kernels.skinny_gemm import is_supported as gemm_supported

needs_dsl = pytest.mark.skipif(not arch.is_available(), reason=f"needs nvidia-cutlass-dsl: {arch.unavailable_reason()}")


@pytest.fixture(autouse=True)
def _fresh_counters():
    counters.reset()
    yield
    counters.reset()


def test_counters_snapshot_and_reset():
    counters.count_launch("k")
    counters.count_launch("k", 2)
    counters.count_fallback("op", "why")
    snap = counters.snapshot()
    assert snap == {"launches": {"k": 3}, "fallbacks": {"op": {"why": 1}}}
    snap["launches"]["k"] = 99  # a copy
    assert counters.launches("k") == 3 and counters.fallbacks("op") == 1 and counters.fallbacks() == 1
    counters.reset()
    assert counters.snapshot() == {"launches": {}, "fallbacks": {}}


def test_cpu_calls_fall_back_with_reason_and_match_reference():
    """On CPU tensors every op serves the call from its reference and counts why; nothing launches."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).bfloat16()
    r = torch.randn(3, 64, generator=g).bfloat16()
    w = torch.randn(64, generator=g).bfloat16()
    out, h = rmsnorm_residual(x, r, w, 1e-5)
    ref_out, ref_h = rmsnorm_residual_ref(x, r, w, 1e-5)
    assert torch.equal(out, ref_out) and torch.equal(h, ref_h)

    wm = torch.randn(48, 64, generator=g).bfloat16()
    y = skinny_gemm(x, wm)
    assert torch.equal(y, skinny_gemm_ref(x, wm))

    src = torch.randn(3, 2, 64, generator=g).bfloat16()
    mix, normed = attn_res_mix(src, w, w, 1e-5, out_w=w)
    rmix, rnormed = attn_res_mix_ref(src, w, w, 1e-5, w)
    assert torch.equal(mix, rmix) and torch.equal(normed, rnormed)

    snap = counters.snapshot()
    assert snap["launches"] == {}
    for op in ("rmsnorm_residual", "skinny_gemm", "attn_res_mix"):
        assert sum(snap["fallbacks"][op].values()) == 1, snap
        (reason,) = snap["fallbacks"][op]
        assert reason in ("no cuda device", "cutlass-dsl unavailable"), reason


def test_fallback_reasons_name_the_envelope():
    x = torch.randn(65, 64).bfloat16()
    wm = torch.randn(48, 64).bfloat16()
    assert "M=65" in gemm_supported(x, wm).reason
    assert gemm_supported(x, wm[:, :32]).reason == "w shape [48, 32] (needs [N, K] = [48, 64])"  # K mismatch
    out = torch.empty(3, 64, dtype=torch.bfloat16)
    rmsnorm_residual(x[:3], None, torch.ones(64).bfloat16(), 1e-5, out=out)
    assert torch.equal(out, rmsnorm_residual_ref(x[:3], None, torch.ones(64).bfloat16(), 1e-5)[0])


def test_heuristic_configs_are_valid_for_every_rank_shape():
    from k3_fastpath.presets import preset

    for name in ("k3-tp8-rank", "k3-tp16-rank", "k3-mini", "k3-tiny"):
        for (N, K) in preset(name).shapes.gemm_shapes().values():
            for M in range(1, 65):
                cfg = SkinnyGemmConfig.from_heuristic(M, N, K)
                assert cfg.m_max >= M and K % cfg.k_granule == 0
                assert cfg.smem_bytes <= 48 * 1024 and cfg.threads <= 1024
    assert RMSNormConfig.from_heuristic(7168) == RMSNormConfig(224, 4, True)


def _key(**kw):
    base = dict(kernel="k", dtype="bf16", shapes=(1, 2), config=RMSNormConfig(32, 1))
    base.update(kw)
    return compile_cache.CompileKey.make(**base)


def test_compile_key_covers_every_field():
    k = _key()
    assert k.source_hash == compile_cache.source_hash() and k.arch == arch.compile_arch()
    assert k.digest() == _key().digest()
    others = [_key(dtype="fp16"), _key(shapes=(1, 3)), _key(config=RMSNormConfig(64, 1)), _key(kernel="j"),
              dataclasses.replace(k, source_hash="x"), dataclasses.replace(k, cutlass_version="0"),
              dataclasses.replace(k, arch="sm_100a")]
    assert len({k.digest(), *(o.digest() for o in others)}) == len(others) + 1


def test_cache_hit_is_a_dict_lookup_and_miss_during_capture_raises(monkeypatch, tmp_path):
    monkeypatch.setenv("K3_KERNEL_CACHE", str(tmp_path))
    calls = []
    key = _key(kernel="fake_kernel_for_test")
    fn = compile_cache.get_or_compile(key, lambda opts: calls.append(opts) or (lambda: 7))
    assert fn() == 7 and len(calls) == 1 and "--gpu-arch" in calls[0]
    assert compile_cache.get_or_compile(key, lambda opts: 1 / 0) is fn
    monkeypatch.setattr(compile_cache, "is_capturing", lambda: True)
    assert compile_cache.get_or_compile(key, lambda opts: 1 / 0) is fn  # a hit is fine while capturing
    with pytest.raises(compile_cache.CompileDuringCaptureError, match="precompile"):
        compile_cache.get_or_compile(_key(kernel="never_compiled"), lambda opts: 1 / 0)


def _layout(ct) -> str:
    """'(9,?,7168):(?i64,7168,1)' from a runtime or a fake tensor: divisibility hints dropped, the
    integer width of dynamic strides kept."""
    import re

    s = re.sub(r"\{(i\d+)?[^}]*\}", lambda m: m.group(1) or "", str(ct)).replace(" ", "")  # keep int width
    if s.startswith("FakeTensor<"):
        _, shape, stride = re.match(r"FakeTensor<(\w+),(\(.*\)),(\(.*\))>", s).groups()
        return f"{shape}:{stride}".replace(",)", ")")
    return re.search(r"o(\(.*\):\(.*\))>", s).group(1)


@needs_dsl
@pytest.mark.parametrize("shape,dynamic", [((5, 7168), (0,)), ((1, 128), (0,)), ((7168,), ()),
                                           ((9, 5, 7168), (1,)), ((4, 51, 128, 8), ())])
def test_to_cute_matches_the_compile_time_fake(shape, dynamic):
    """The runtime tensor must have the MLIR type the kernel was compiled for (same static extents,
    same dynamic dims and strides): the launch path does not re-check it."""
    from k3_fastpath._lib.tensor import fake_tensor, to_cute

    t = torch.zeros(shape, dtype=torch.bfloat16)
    fake_shape = [None if i in dynamic else n for i, n in enumerate(shape)]
    assert _layout(to_cute(t, dynamic_dims=dynamic)) == _layout(fake_tensor(torch.bfloat16, fake_shape))


@needs_dsl
def test_to_cute_rejects_what_the_kernel_cannot_read():
    from k3_fastpath._lib.tensor import to_cute

    t = torch.zeros(5, 7168, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        to_cute(t.t())
    with pytest.raises(ValueError, match="aligned"):
        to_cute(t.view(-1)[1:7169].view(1, 7168))
    odd = torch.zeros(7168, 1, dtype=torch.bfloat16).t()  # [1, 7168], contiguous, stride (1, 1)
    assert odd.is_contiguous() and odd.stride() == (1, 1)
    assert _layout(to_cute(odd)) == "(?,7168):(7168,1)"


@needs_dsl
def test_disk_cache_keeps_artifacts_and_reports_export(tmp_path, monkeypatch):
    """The disk entry always holds key.json + PTX + cubin; export status is recorded (GPU hosts may export)."""
    from k3_fastpath.kernels.rmsnorm_residual import compile_rmsnorm_residual

    monkeypatch.setenv("K3_KERNEL_CACHE", str(tmp_path))
    compile_cache.clear_memory()
    cfg = RMSNormConfig.from_heuristic(128, has_residual=False)
    compile_rmsnorm_residual("bf16", 128, cfg)
    key = compile_cache.CompileKey.make("rmsnorm_residual", "bf16", (128,), cfg)
    d = compile_cache.entry_dir(key)
    assert (d / "key.json").is_file() and set(compile_cache.artifact_paths(key)) == {"ptx", "cubin"}
    assert "export" in compile_cache.disk_status()
    assert compile_cache.records()[-1].source in ("compiled", "disk")
    compile_cache.clear_memory()


def test_package_imports_without_dsl_imports():
    """Importing the registry and every kernel api must not import cutlass (CPU CI without the DSL)."""
    import subprocess
    import sys

    code = ("import sys; import k3_fastpath.kernels as k; [k.api(n) for n in k.names()]; "
            "import k3_fastpath._lib.compile_cache, k3_fastpath._lib.tensor; "
            "assert 'cutlass' not in sys.modules, 'cutlass imported eagerly'")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": root})
