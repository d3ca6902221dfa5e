"""The standard path's compiled glue (``standard_op_table(compiled_glue=True)``, runtime/compiled_glue.py) on a
CPU: no compile is attempted (torch.compile is replaced by a spy that fails the test), every op serves the
eager function bit for bit and its reason says why; the capture guards (a new shape inside capture raises,
a known one replays under ``fail_on_recompile``) and the compile-failure fallback, with a fake compiler.
One test traces with real dynamo on its ``eager`` backend (no inductor, no C++ toolchain, well under a
second) to check that a guard miss during capture raises instead of recompiling.

On a GPU (tests/test_standard_path_gpu.py) the glue really compiles, captures and matches the eager glue."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath._lib.compile_cache import CompileDuringCaptureError
from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime import compiled_glue as G
from k3_fastpath.runtime import standard_ops as S
from k3_fastpath.runtime.envelope import Envelope
from k3_fastpath.runtime.executor import DecodeExecutor
from k3_fastpath.runtime.options import DecodeOptions
from k3_fastpath.synthetic import synthetic_state_dict

CFG = preset("k3-tiny").config
GLUE_OPS = ("rmsnorm", "attn_res", "kda_step", "moe_router", "moe_experts")


@pytest.fixture(scope="module")
def m16():
    return load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.bfloat16)


@pytest.fixture
def no_compile(monkeypatch):
    """torch.compile replaced by a spy: any call fails the test (and nothing compiles)."""
    calls = []

    def spy(*a, **k):
        calls.append((a, k))
        raise AssertionError("torch.compile was called on a CPU")

    monkeypatch.setattr(torch, "compile", spy)
    return calls


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _same(a, b):
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and torch.equal(a, b)


@torch.no_grad()
def test_cpu_table_falls_back_to_the_eager_functions_bit_for_bit(m16, no_compile, seed):
    """Each op of the compiled-glue table on CPU tensors == the eager function on the same inputs (outputs and
    in-place pool updates equal bitwise), no compile attempted, the reasons say eager on cpu."""
    from k3_fastpath.runtime.step_plan import ExpertBank

    table = S.standard_op_table(compiled_glue=True)  # device unknown until the first glue call
    assert all(G.GLUE_COMPILED in table[n].standard_reason for n in GLUE_OPS)
    g = torch.Generator().manual_seed(seed)

    def r(*s, dt=torch.bfloat16, sc=1.0):
        return (torch.randn(*s, generator=g) * sc).to(dt)

    B, Hd = 3, CFG.hidden_size
    x, res = r(B, Hd), r(B, 48)
    cases = {
        "rmsnorm": (S.rmsnorm_standard, (x, r(Hd) + 1, 1e-5), {}),
        "attn_res": (S.attn_res_standard, (r(3, B, Hd), r(Hd) + 1, r(Hd, sc=0.1), 1e-5, r(Hd) + 1), {}),
        "linear": (S.linear_standard, (x, r(48, Hd)), {"residual": res, "out": res}),
    }
    H, D, N = 2, 16, 6
    C = H * D
    kda = (r(B, C), r(B, C), r(B, C), r(B, C), r(B, C), r(B, H), r(C, 4, sc=0.5), r(C, 4, sc=0.5), r(C, 4, sc=0.5),
           r(H + 2, dt=torch.float32), r(C, dt=torch.float32), r(D) + 1, torch.tensor([3, 0, 5], dtype=torch.int32),
           r(N, 3, C), r(N, 3, C), r(N, 3, C), r(N, H, D, D, dt=torch.float32))
    cases["kda_step"] = (S.kda_step_standard, kda, {"eps": 1e-5, "lower_bound": -5.0})
    moe = m16.model.layers[1].block_sparse_moe
    gate = moe.gate
    cases["moe_router"] = (S.moe_router_standard_lib, (x, gate.weight, gate.e_score_correction_bias, gate.top_k,
                                                       True, 2.5), {})
    ids, w = S.moe_router_standard_lib(x, gate.weight, gate.e_score_correction_bias, gate.top_k, True, 1.0)
    z = moe.routed_expert_down_proj(x)
    bank = ExpertBank(moe, CFG)
    cases["moe_experts"] = (S.moe_experts_standard, (z, ids, w, bank, moe.routed_expert_norm.weight, 1e-5), {})
    for name, (eager, args, kw) in cases.items():
        a1, a2 = _clone(args), _clone(args)
        k1, k2 = ({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()} for _ in range(2))
        if name == "linear":  # the in-place residual form: out is the residual
            k1["out"], k2["out"] = k1["residual"], k2["residual"]
        got, want = table[name](*a1, **k1), eager(*a2, **k2)
        assert _same(got, want), f"seed {seed}: {name} differs from its eager function"
        assert all(_same(p, q) for p, q in zip(a1, a2, strict=True) if isinstance(p, torch.Tensor)), name
    unfused = S.moe_experts_standard(z, ids, w, bank)  # the TP form: FP32 sum without the latent norm
    assert _same(table["moe_experts"](z, ids, w, bank), unfused)
    assert not no_compile
    for n in GLUE_OPS:
        why = table[n].standard_reason
        assert G.GLUE_EAGER in why and "cpu tensors" in why and G.GLUE_COMPILED not in why, (n, why)
    assert "cpu tensors" in table["linear"].standard_reason
    assert S.glue_summary(table) == "eager"


def test_tables_say_what_serves_their_glue(monkeypatch):
    """Reasons per device and state: the eager-glue table is unchanged; a cpu table says eager from the
    start; a CUDA table (torch.compile usable) says torch.compile, and a compile failure turns that op's
    reason (and only its) to eager with the failure; ``glue_summary`` follows."""
    plain = S.standard_op_table()
    assert all("glue:" not in o.standard_reason for o in plain.values()) and S.glue_summary(plain) == "eager"
    cpu = S.standard_op_table(compiled_glue=True, device="cpu")
    assert all(G.GLUE_EAGER in cpu[n].standard_reason for n in GLUE_OPS) and S.glue_summary(cpu) == "eager"
    monkeypatch.setattr(G, "compile_unavailable", lambda device: None)
    cuda = S.standard_op_table(compiled_glue=True, device="cuda")
    assert cuda["linear"].standard_reason == S.CUBLAS_FUSED
    assert all(G.GLUE_COMPILED in cuda[n].standard_reason and G.GLUE_EAGER not in cuda[n].standard_reason
               for n in GLUE_OPS)
    assert S.glue_summary(cuda) == "torch.compile"
    assert {n: g.fn for n, g in G.shared_glue_fns().items() if n in S.GLUE_FNS} == S.GLUE_FNS  # the same functions
    monkeypatch.setattr(G.shared_glue_fns()["experts_combine"], "failed", "torch.compile of experts_combine raised X")
    cuda["rmsnorm"].fn.func.on_change()  # what GlueSet does when a shared compile fails
    why = cuda["moe_experts"].standard_reason
    assert "experts_dispatch" in why and "+ eager (torch.compile of experts_combine raised X)" in why, why
    assert G.GLUE_EAGER not in cuda["rmsnorm"].standard_reason
    assert S.glue_summary(cuda) == "torch.compile (partly eager)"


class _FakeCompiler:
    """Stands in for torch.compile: counts compiles and calls of the compiled function, optionally raises."""

    def __init__(self, error: Exception | None = None) -> None:
        self.compiles, self.calls, self.error = [], 0, error

    def __call__(self, fn, **kwargs):
        self.compiles.append(kwargs)

        def compiled(*a, **k):
            self.calls += 1
            if self.error is not None:
                raise self.error
            return fn(*a, **k)
        return compiled


def test_glue_fn_compiles_outside_capture_and_refuses_inside(monkeypatch, seed):
    """One compile per process and function with the options the task fixes; a known key replays inside
    capture; a new key inside capture raises CompileDuringCaptureError before anything compiles or runs."""
    fake = _FakeCompiler()
    monkeypatch.setattr(torch, "compile", fake)
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(4, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    fn = G.GlueFn("test_rmsnorm", S.rmsnorm_standard)
    assert torch.equal(fn(x, w, 1e-5), S.rmsnorm_standard(x, w, 1e-5))
    assert fake.compiles == [{"fullgraph": True, "dynamic": False, "mode": "default"}] and len(fn.keys) == 1
    fn(x, w, 1e-5)
    monkeypatch.setattr(G, "_capturing", lambda: True)
    assert torch.equal(fn(x, w, 1e-5), S.rmsnorm_standard(x, w, 1e-5))
    assert fake.calls == 3 and len(fake.compiles) == 1
    for args in ((x[:3], w, 1e-5), (x, w, 1e-6), (x.float(), w, 1e-5), (x.t().contiguous().t(), w, 1e-5)):
        with pytest.raises(CompileDuringCaptureError, match="not compiled before CUDA-graph capture"):
            fn(*args)  # another shape, eps, dtype, strides
    assert fake.calls == 3 and len(fake.compiles) == 1 and len(fn.keys) == 1
    monkeypatch.setattr(G, "_capturing", lambda: False)
    fn(x[:3], w, 1e-5)  # outside capture a new shape compiles (dynamo's cache; here the fake's)
    assert len(fn.keys) == 2 and fake.calls == 4


def test_glue_fn_failed_compile_serves_eagerly_and_says_why(monkeypatch, seed):
    fake = _FakeCompiler(RuntimeError("inductor exploded\nsecond line"))
    monkeypatch.setattr(torch, "compile", fake)
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(3, 2, 32, generator=g).bfloat16()
    nw, pw, ow = (torch.randn(32, generator=g).bfloat16() for _ in range(3))
    fn = G.GlueFn("test_attn_res", S.attn_res_standard)
    with pytest.warns(UserWarning, match="runs eagerly"):
        got = fn(src, nw, pw, 1e-5, ow)
    assert torch.equal(got, S.attn_res_standard(src, nw, pw, 1e-5, ow))
    assert fn.failed is not None and "RuntimeError: inductor exploded" in fn.failed and "second" not in fn.failed
    fn(src, nw, pw, 1e-5, ow)
    assert fake.calls == 1 and not fn.keys  # eager from then on, no second attempt


def test_shape_key_covers_what_dynamo_specialises_on():
    x = torch.zeros(4, 8)
    base = G.shape_key((x, 1e-5, torch.bfloat16, None), {})
    for other in ((torch.zeros(5, 8), 1e-5, torch.bfloat16, None), (torch.zeros(8, 4).t(), 1e-5, torch.bfloat16, None),
                  (x.double(), 1e-5, torch.bfloat16, None), (x, 1e-6, torch.bfloat16, None),
                  (x, 1e-5, torch.float32, None), (x, 1e-5, torch.bfloat16, x),
                  (torch.nn.Parameter(x), 1e-5, torch.bfloat16, None)):
        assert G.shape_key(other, {}) != base
    assert G.shape_key((torch.ones(4, 8), 1e-5, torch.bfloat16, None), {}) == base  # values are not part of it
    with torch.no_grad():
        assert G.shape_key((x, 1e-5, torch.bfloat16, None), {}) != base


_SCALE = 2.0


def _scaled(x):
    return x * _SCALE


def test_dynamo_guard_miss_inside_capture_raises_instead_of_recompiling(monkeypatch):
    """Real dynamo (backend "eager": tracing only): a key compiled outside capture whose guard fails for a
    reason the key does not cover (a global changed) raises CompileDuringCaptureError inside capture; outside
    capture the same call recompiles and is right."""
    global _SCALE
    fn = G.GlueFn("test_scaled", _scaled, compile_kwargs={"backend": "eager", "fullgraph": True, "dynamic": False})
    x = torch.ones(3)
    assert torch.equal(fn(x), x * 2.0) and fn.failed is None
    monkeypatch.setattr(G, "_capturing", lambda: True)
    assert torch.equal(fn(x), x * 2.0)  # the compiled key replays inside capture
    monkeypatch.setitem(globals(), "_SCALE", 3.0)
    with pytest.raises(CompileDuringCaptureError, match="would recompile during CUDA-graph capture"):
        fn(x)
    monkeypatch.setattr(G, "_capturing", lambda: False)
    assert torch.equal(fn(x), x * 3.0) and fn.failed is None


@torch.no_grad()
def test_executor_with_compiled_glue_on_cpu_equals_eager_glue(m16, no_compile, seed):
    """``DecodeOptions(standard_compiled_glue=True)`` on a CPU: the same logits bit for bit as the eager-glue
    executor, nothing compiled, the trace's ops and step records say eager on cpu."""
    kw = dict(backend="standard_graph", max_len=16, max_batch=4, envelope=Envelope(emulate=True))
    eager, comp = DecodeExecutor(m16, **kw), DecodeExecutor(m16, options=DecodeOptions(standard_compiled_glue=True), **kw)
    assert comp.trace.meta["standard_compiled_glue"] and not eager.trace.meta["standard_compiled_glue"]
    g = torch.Generator().manual_seed(seed)
    ca, cb = eager.new_cache(3), comp.new_cache(3)
    active = torch.tensor([True, False, True])
    for _ in range(2):
        tok = torch.randint(3, CFG.vocab_size, (3,), generator=g)
        assert torch.equal(eager.decode(tok, ca, active), comp.decode(tok, cb, active)), f"seed {seed}"
    assert not no_compile
    assert all("cpu tensors" in comp.trace.meta["ops"][n] for n in GLUE_OPS)
    ops = {o["op"]: o["reason"] for o in comp.trace.records[-1].standard_ops}
    assert all(G.GLUE_EAGER in ops[n] for n in GLUE_OPS), ops
