"""Programmatic dependent launch (PDL) builds of the decode kernels, checked on a CPU (no GPU needed).

K3.md failure 2: a kernel launched with PDL that reads an activation before ``griddepcontrol.wait`` reads
its predecessor's output before it is written (NaN logits under load). Every kernel whose spec says
``pdl`` has a ``pdl`` config flag (``PDL_KERNELS``, derived from the specs); for one shape per kernel other
than the skinny GEMM (``test_executor_cpu.py`` checks that one: ``PDL_CHECKED_ELSEWHERE``; the k3-tp8-rank
rank; each launch of the multi-launch kernels) this module compiles the PDL build and:

1. the launch carries the PDL attribute (``launch(use_pdl=True)``, recorded while compiling), the flag is
   part of the compile-cache key, and the non-PDL twin has no griddepcontrol instruction at all;
2. PTX (where ``griddepcontrol.wait`` is a named instruction): an unpredicated wait exists; before it the
   kernel issues no global store / atomic, and every global load or L2 prefetch before it has an address
   derived only from the kernel's *weight* parameters (``pdl_tools.py``: a forward data-flow analysis from
   the ``ld.param`` of each pointer through every instruction and branch, so an address built from a
   routing id or a slot index counts as an activation); no branch skips the wait or jumps back over it, no
   ``ret`` precedes it; ``griddepcontrol.launch_dependents`` exists and comes after the wait;
3. SASS (nvdisasm of the cubin): the same over the machine code, where the wait is ``ACQBULK`` and the
   trigger ``PREEXIT``: taint starts at the constant-bank words holding each pointer parameter
   (``c[0x0][0x210 + offset]``, offsets from the PTX parameter list), so the check holds for the code the
   GPU runs, after ptxas scheduling;
4. where a kernel is meant to read weights before the wait (rmsnorm, attn_res_mix, kda, router, the MoE
   combine, the MLA combine's W_UV prefetch), it does; where nothing may be read (MLA attention, the MoE
   plan and both grouped GEMMs: which experts they read depends on the router; the SiTU-GLU activation,
   which reads only activations), nothing global is touched; what is read is within the kernel spec's
   ``pdl_prologue_reads``, which (checked without the DSL) is exactly the weights its cases expect read.
Besides: every kernel compiles with ``pdl=True`` for every decode variant of k3-tiny (the model the GPU
executor test runs with ``pdl=True``), no PDL build spills, the analysis itself flags an early activation
load or store on hand-written PTX / SASS, and ``op_table(DecodeOptions(pdl=True))`` binds ``pdl=True`` to
every kernel op with a PDL build (that last part needs no DSL). The bitwise GPU check is ``test_executor_gpu.py::test_pdl_changes_no_bit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from pdl_tools import Param, ptx_params, ptx_pre_wait, sass_op, sass_pre_wait
from sass_tools import NVDISASM, isolated_cache, sass_lines

from k3_fastpath import kernels as registry
from k3_fastpath._lib import arch, compile_cache

needs_dsl = pytest.mark.skipif(not arch.is_available(),
                               reason=f"needs nvidia-cutlass-dsl: {arch.unavailable_reason()}")
needs_nvdisasm = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")

PDL_KERNELS = tuple(s.name for s in registry.all_specs() if s.pdl)  # every kernel with a PDL build
# kernels whose PDL build's pre-wait reads are checked by another test instead of a Case below
PDL_CHECKED_ELSEWHERE = {
    "skinny_gemm": "tests/test_executor_cpu.py::test_pdl_skinny_gemm_waits_before_reading_activations"}


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(tmp_path_factory):
    yield from isolated_cache(tmp_path_factory, "k3_pdl_cache")


# ------------------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[bool], compile_cache.CompileKey]  # compiles the (non-)PDL build, returns its key
    roles: tuple[str, ...]  # the kernel's parameters, in order
    weights: frozenset  # parameters a step never writes (may be read before the wait)
    reads_before_wait: bool  # the kernel is meant to read (or prefetch) weights before the wait

    @property
    def kernel(self) -> str:
        return self.id.split("-")[0]


@contextmanager
def recorded_launches():
    """use_pdl of every kernel launch traced while compiling (the DSL's KernelLauncher.launch)."""
    from cutlass.cutlass_dsl import cutlass as dsl

    seen: list = []
    orig = dsl.KernelLauncher.launch

    def launch(self, *args, **kwargs):
        seen.append(bool(kwargs.get("use_pdl", False)))
        return orig(self, *args, **kwargs)

    dsl.KernelLauncher.launch = launch
    try:
        yield seen
    finally:
        dsl.KernelLauncher.launch = orig


def _tp8():
    from k3_fastpath.presets import preset

    return preset("k3-tp8-rank")


def _rmsnorm(pdl: bool):
    from k3_fastpath.kernels.rmsnorm_residual import RMSNormConfig, compile_rmsnorm_residual

    H = _tp8().config.hidden_size
    cfg = RMSNormConfig.from_heuristic(H, has_residual=True, pdl=pdl)
    compile_rmsnorm_residual("bf16", H, cfg)
    return compile_cache.CompileKey.make("rmsnorm_residual", "bf16", (H,), cfg)


def _attn_res(S: int):
    def build(pdl: bool):
        from k3_fastpath.kernels.attn_res_mix import AttnResConfig, compile_attn_res_mix

        H = _tp8().config.hidden_size
        cfg = AttnResConfig.from_heuristic(S, H, has_norm=True, pdl=pdl)
        compile_attn_res_mix("bf16", S, H, cfg)
        return compile_cache.CompileKey.make("attn_res_mix", "bf16", (S, H), cfg)
    return build


def _kda(tokens: int, vllm_layout: bool = False):
    """The decode build (``tokens`` 1), a speculative verify build, or the decode build on vLLM's cache layout."""
    def build(pdl: bool):
        from k3_fastpath.kernels.kda_decode import KDADecodeConfig, compile_kda_decode

        p = _tp8()
        H, D = p.shapes.kda_heads, p.config.linear_attn_config.head_dim
        cfg = KDADecodeConfig.from_heuristic(D, pdl=pdl, tokens=tokens, vllm_layout=vllm_layout)
        compile_kda_decode("bf16", H, D, cfg)
        return compile_cache.CompileKey.make("kda_decode", "bf16", (H, D), cfg)
    return build


def _router(pdl: bool):
    from k3_fastpath.kernels.moe_router import MoERouterConfig, compile_moe_router

    c = _tp8().config
    E, k = c.num_experts, c.num_experts_per_token
    cfg = MoERouterConfig.from_heuristic(E, k, c.moe_renormalize, pdl=pdl)
    compile_moe_router("fp32", E, k, cfg)
    return compile_cache.CompileKey.make("moe_router", "fp32", (E, k), cfg)


def _mla_variant(dtype: str, pdl: bool):
    from k3_fastpath.kernels.mla_decode import api

    v = next(v for v in api.compile_variants("k3-tp8-rank") if v["dtype"] == dtype)
    return v, dataclasses.replace(v["config"], pdl=pdl)


def _mla_attention(dtype: str):
    def build(pdl: bool):
        from k3_fastpath.kernels.mla_decode import api

        v, cfg = _mla_variant(dtype, pdl)
        shapes = (v["H"], v["R"], v["P"], v["page_size"])
        api.compile_mla_attention(dtype, *shapes, cfg)
        return compile_cache.CompileKey.make("mla_decode", dtype, shapes, cfg)
    return build


def _mla_combine(final: bool):
    def build(pdl: bool):
        from k3_fastpath.kernels.mla_decode import api
        from k3_fastpath.kernels.mla_decode.config import MAX_SPLITS

        v, cfg = _mla_variant("bf16", pdl)
        V = v["V"] if final else 1
        api.compile_mla_combine(v["H"], v["R"], V, final, cfg)
        knobs = (cfg.gate and final, cfg.combine_rows, MAX_SPLITS) + (("pdl",) if pdl else ())
        return compile_cache.CompileKey.make("mla_decode_combine", "fp32",
                                             (v["H"], v["R"], V, "final" if final else "partial"), knobs)
    return build


def _moe():
    from k3_fastpath.kernels.moe_experts import api

    return api, api.compile_variants("k3-tp8-rank")[0]


def _moe_plan(pdl: bool):
    api, v = _moe()
    api.compile_plan(v["E"], 64, pdl)
    return compile_cache.CompileKey.make("moe_experts_plan", "i32", (v["E"], 64), ("pdl",) if pdl else None)


def _moe_gemm(glu: bool):
    def build(pdl: bool):
        api, v = _moe()
        c = v["config"].with_pdl() if pdl else v["config"]
        rows, K, gcfg = (v["I"], v["L"], c.glu) if glu else (v["L"], v["I"], c.down)
        api.compile_gemm(v["E"], rows, K, v["k_top"], c.beta, c.linear_beta, gcfg)
        return compile_cache.CompileKey.make("moe_experts_gemm", gcfg.fmt,
                                             (v["E"], rows, K, v["k_top"], c.beta, c.linear_beta), gcfg)
    return build


def _moe_combine(pdl: bool):
    from k3_fastpath.kernels.moe_experts.config import COMBINE_THREADS

    api, v = _moe()
    api.compile_combine(v["L"], v["k_top"], True, pdl)
    return compile_cache.CompileKey.make("moe_experts_combine", "bf16", (v["L"], v["k_top"], True),
                                         (COMBINE_THREADS, "pdl") if pdl else COMBINE_THREADS)


def _situ_glu(pdl: bool):
    from k3_fastpath.kernels.situ_glu import api

    v = api.compile_variants("k3-tp8-rank")[0]
    cfg = dataclasses.replace(v["config"], pdl=pdl)
    api.compile_situ_glu("bf16", v["I"], cfg)
    return compile_cache.CompileKey.make("situ_glu", "bf16", (v["I"],), cfg)


_PLAN = ("n_active", "act_expert", "act_start", "act_count", "sorted_pair")
CASES = [
    Case("rmsnorm_residual", _rmsnorm, ("x", "residual", "weight", "out", "residual_out", "eps"),
         frozenset({"weight"}), True),
    Case("attn_res_mix-S4", _attn_res(4), ("sources", "norm_w", "proj_w", "mix", "out_w", "normed", "eps", "out_eps"),
         frozenset({"norm_w", "proj_w", "out_w"}), True),
    Case("attn_res_mix-S9-reload", _attn_res(9),
         ("sources", "norm_w", "proj_w", "mix", "out_w", "normed", "eps", "out_eps"),
         frozenset({"norm_w", "proj_w", "out_w"}), True),
    *(Case(name, _kda(tokens, vllm), ("q", "k", "v", "g", "a", "beta", "conv_q_w", "conv_k_w", "conv_v_w", "A_log",
                                      "dt_bias", "o_norm_w", "slot", "slot_out", "conv_q", "conv_k", "conv_v", "state",
                                      "out", "eps", "lower_bound", "conv_stride", "state_stride"),
           frozenset({"conv_q_w", "conv_k_w", "conv_v_w", "A_log", "dt_bias", "o_norm_w"}), True)
      for name, tokens, vllm in (("kda_decode", 1, False), ("kda_decode-verify-T8", 8, False),
                                 ("kda_decode-vllm-layout", 1, True))),
    Case("moe_router", _router, ("logits", "bias", "ids", "weights", "scale"), frozenset({"bias"}), True),
    Case("mla_decode-attention-bf16", _mla_attention("bf16"),
         ("q_lat", "q_pe", "cache", "block_table", "ctx_len", "cache_scale", "o_part", "lse", "scale_log2", "chunk",
          "page_stride"),
         frozenset(), False),
    Case("mla_decode-attention-fp8", _mla_attention("fp8"),
         ("q_lat", "q_pe", "cache", "block_table", "ctx_len", "cache_scale", "o_part", "lse", "scale_log2", "chunk",
          "page_stride"),
         frozenset(), False),
    Case("mla_decode-combine-final", _mla_combine(True), ("o_part", "lse", "w_uv", "gate", "out"),
         frozenset({"w_uv"}), True),
    Case("mla_decode-combine-partial", _mla_combine(False), ("o_part", "lse", "o_lat", "lse_out"),
         frozenset(), False),
    Case("moe_experts-plan", _moe_plan, ("ids", *_PLAN), frozenset(), False),
    Case("moe_experts-gate_up", _moe_gemm(True), ("x", "w1", "w1_scale", "w3", "w3_scale", *_PLAN, "out"),
         frozenset({"w1", "w1_scale", "w3", "w3_scale"}), False),
    Case("moe_experts-down", _moe_gemm(False), ("x", "w2", "w2_scale", *_PLAN, "out"),
         frozenset({"w2", "w2_scale"}), False),
    Case("moe_experts-combine", _moe_combine, ("y", "route_w", "out", "norm_w", "eps"), frozenset({"norm_w"}), True),
    Case("situ_glu", _situ_glu, ("g", "u", "h"), frozenset(), False),
]


def _assert_reads_declared(case: Case, loads) -> None:
    """The parameters read before the wait are among those the kernel's spec declares (pdl_prologue_reads)."""
    read = {n for _, names in loads for n in names}
    declared = set(registry.spec(case.kernel).pdl_prologue_reads)
    assert read <= declared, f"{case.id} reads {sorted(read - declared)} before the wait; its spec declares {declared}"


def test_cases_cover_every_pdl_kernel_and_match_its_spec():
    """Without the DSL: every kernel with a PDL build has a Case (or a check named in PDL_CHECKED_ELSEWHERE),
    every Case is a registered PDL kernel's, and each spec's ``pdl_prologue_reads`` are exactly the weights
    its Cases expect read before the wait (parameters a step never writes)."""
    by_kernel: dict[str, list[Case]] = {}
    for c in CASES:
        by_kernel.setdefault(c.kernel, []).append(c)
    assert set(by_kernel) <= set(PDL_KERNELS), f"Cases of kernels without a PDL spec: {set(by_kernel) - set(PDL_KERNELS)}"
    assert not set(by_kernel) & set(PDL_CHECKED_ELSEWHERE)
    assert set(by_kernel) | set(PDL_CHECKED_ELSEWHERE) == set(PDL_KERNELS), "a PDL kernel has no pre-wait check"
    for test in PDL_CHECKED_ELSEWHERE.values():
        path, _, name = test.partition("::")
        assert f"def {name}(" in (Path(__file__).resolve().parents[1] / path).read_text(), test
    for kernel, cases in by_kernel.items():
        declared = set(registry.spec(kernel).pdl_prologue_reads)
        expected = set().union(*(c.weights for c in cases if c.reads_before_wait))
        assert declared == expected, f"{kernel}: spec pdl_prologue_reads {declared}, its cases expect {expected}"
        assert declared <= set().union(*(c.weights for c in cases)), f"{kernel}: declares a non-weight read"


def _artifacts(key):
    paths = compile_cache.artifact_paths(key)
    assert "ptx" in paths and "cubin" in paths, f"no PTX / cubin kept for {key}"
    return paths


_built: dict[tuple[str, bool], tuple] = {}


def _build(case: Case, pdl: bool):
    """(key, recorded use_pdl of the launch, ptx text, cubin path), compiled once per module."""
    if (case.id, pdl) not in _built:
        with recorded_launches() as seen:
            key = case.build(pdl)
        paths = _artifacts(key)
        _built[case.id, pdl] = (key, list(seen), paths["ptx"].read_text(), paths["cubin"])
    return _built[case.id, pdl]


@needs_dsl
@pytest.mark.compile
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pdl_build_is_launched_with_pdl_and_keyed(case):
    key, seen, ptx, _ = _build(case, True)
    key0, seen0, ptx0, _ = _build(case, False)
    assert seen == [True], f"the PDL build's launch(use_pdl=...) calls: {seen}"
    assert seen0 == [False], f"the default build's launch(use_pdl=...) calls: {seen0}"
    assert key != key0 and key.digest() != key0.digest(), "pdl is not part of the compile-cache key"
    assert "griddepcontrol" not in ptx0, "the default build contains griddepcontrol instructions"
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


@needs_dsl
@pytest.mark.compile
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_ptx_reads_only_weights_before_the_wait(case):
    _, _, ptx, _ = _build(case, True)
    region = ptx_pre_wait(ptx, ptx_params(ptx, list(case.roles)), set(case.weights))
    assert not region.problems, "\n".join(region.problems)
    _assert_reads_declared(case, region.loads)
    if case.reads_before_wait:
        assert region.loads, "expected the weights to be read (or prefetched) before the wait"
    else:
        assert not region.loads, f"expected no global access before the wait: {region.loads}"
    print(f"\n[ptx] {case.id}: {len(region.loads)} weight reads/prefetches before griddepcontrol.wait: "
          f"{sorted({n for _, s in region.loads for n in s})}")


@needs_dsl
@needs_nvdisasm
@pytest.mark.compile
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_sass_reads_only_weights_before_acqbulk(case):
    _, _, ptx, cubin = _build(case, True)
    lines = sass_lines(cubin)
    region = sass_pre_wait(lines, ptx_params(ptx, list(case.roles)), set(case.weights))
    assert not region.problems, "\n".join(region.problems)
    _assert_reads_declared(case, region.loads)
    if case.reads_before_wait:
        assert region.loads, "expected the weights to be read (or prefetched) before ACQBULK"
    else:
        assert not region.loads, f"expected no global access before ACQBULK: {region.loads}"
    _, _, _, cubin0 = _build(case, False)
    ops0 = {sass_op(ln) for ln in sass_lines(cubin0) if not ln.startswith(".L")}
    assert not ops0 & {"ACQBULK", "PREEXIT"}, "the default build waits / triggers"
    print(f"\n[sass] {case.id}: {[ln for ln, _ in region.loads]}")


# ------------------------------------------------------------------------------------------ the analysis can fail
_FAKE_PTX = """
.visible .entry k(
\t.param .align 8 .b8 k_param_0[16],
\t.param .align 8 .b8 k_param_1[8],
\t.param .align 8 .b8 k_param_2[16]
)
{
\t.reg .b64 %rd<9>;
\tld.param.b64 %rd1, [k_param_0];
\tld.param.b64 %rd2, [k_param_1];
\tld.param.b64 %rd3, [k_param_2];
\tadd.s64 %rd4, %rd2, 16;
\tld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd4];
\tmul.wide.s32 %rd5, %r9, 4;
\tadd.s64 %rd6, %rd1, %rd5;
\tLOAD_OR_NOT
\tgriddepcontrol.wait;
\tld.global.b32 %r5, [%rd6];
\tgriddepcontrol.launch_dependents;
\tst.global.b32 [%rd3], %r5;
\tret;
}
"""


@pytest.mark.parametrize("early, problem", [("", None), ("ld.global.b32 %r6, [%rd6];", "['x']"),
                                            ("st.global.b32 [%rd3], %r1;", "global write"),
                                            ("ld.global.b32 %r7, [%rd1];", "['x']")])
def test_ptx_analysis_catches_an_early_activation_load(early, problem):
    """The checker itself: a load of x (param 0) or a store moved above the wait is reported; a weight load
    (param 1, through an add) is not."""
    ptx = _FAKE_PTX.replace("LOAD_OR_NOT", early)
    region = ptx_pre_wait(ptx, ptx_params(ptx, ["x", "w", "y"]), {"w"})
    assert len(region.loads) >= 1 and region.loads[0][1] == frozenset({"w"})
    if problem is None:
        assert not region.problems, region.problems
    else:
        assert any(problem in p for p in region.problems), region.problems


def test_sass_analysis_catches_an_early_activation_load():
    """The SASS checker on hand-written lines: x lives at c[0x0][0x210] (param 0, 16 bytes), W at 0x220."""
    params = [Param("x", "p0", 0, 16, True), Param("w", "p1", 16, 8, True), Param("y", "p2", 24, 16, True)]
    ok = ["LDC.64 R2, c[0x0][0x220]", "IMAD.WIDE.U32 R4, R0, 0x2, R2", "LDG.E.128 R8, desc[UR4][R4.64]",
          "ACQBULK", "LDC.64 R6, c[0x0][0x210]", "LDG.E R12, desc[UR4][R6.64]", "PREEXIT", "EXIT"]
    assert not sass_pre_wait(ok, params, {"w"}).problems
    bad = ok[:3] + ["ULDC.64 UR6, c[0x0][0x210]", "IADD3 R14, P0, R0, UR6, RZ", "IADD3.X R15, RZ, UR7, RZ, P0, !PT",
                    "LDG.E R16, desc[UR4][R14.64]"] + ok[3:]
    assert any("['x']" in p for p in sass_pre_wait(bad, params, {"w"}).problems)
    assert any("launch_dependents before" in p for p in sass_pre_wait(["PREEXIT", "ACQBULK", "EXIT"], params, {"w"}).problems)


# ------------------------------------------------------------------------------------------ k3-tiny grid
def _pdl_variant(kernel: str, v: dict) -> dict:
    v = {k: val for k, val in v.items() if k not in ("shape_name", "M")}
    c = v["config"]
    v["config"] = c.with_pdl() if kernel == "moe_experts" else dataclasses.replace(c, pdl=True)
    return v


@needs_dsl
@pytest.mark.compile
@pytest.mark.parametrize("kernel", PDL_KERNELS)
def test_tiny_preset_compiles_with_pdl(kernel):
    """Every decode variant of k3-tiny (the model the GPU executor test runs with pdl=True) compiles with
    pdl=True, every launch of it with the PDL attribute (multi-launch kernels: each launch)."""
    from k3_fastpath import kernels as registry

    api = registry.api(kernel)
    variants = api.compile_variants("k3-tiny")
    assert variants, f"{kernel} has no k3-tiny variants"
    with recorded_launches() as seen:
        for v in variants:
            assert callable(api.compile_kernel(**_pdl_variant(kernel, v)))
    assert seen and all(seen), f"{kernel}: launches traced with use_pdl={seen}"


@needs_dsl
@pytest.mark.compile
def test_pdl_builds_use_no_local_memory():
    """The weights loaded before the wait stay in registers: no PDL build of this module spills."""
    from sass_tools import frame_sizes

    cubins = sorted(compile_cache.cache_dir().glob("*/*/*.cubin"))
    if not cubins:
        pytest.skip(reason="nothing compiled in this session (run the whole module)")
    bad = [str(c.parent.relative_to(compile_cache.cache_dir())) for c in cubins if any(frame_sizes(c))]
    assert not bad, f"non-zero stack frame: {bad}"


# ------------------------------------------------------------------------------------------ the op table (no DSL)
def test_op_table_pdl_reaches_every_kernel_op():
    """``op_table(DecodeOptions(pdl=True))`` binds ``pdl=True`` to every op whose kernel has a PDL build
    (same adapter, same kernel name for the launch counters) and ``pdl=False`` without it; every kernel with a
    PDL build takes the option in its adapter; ``pdl_support`` names every kernel."""
    from k3_fastpath.runtime import fast_ops
    from k3_fastpath.runtime.executor import pdl_support
    from k3_fastpath.runtime.options import DecodeOptions

    on = fast_ops.op_table(DecodeOptions(pdl=True, situ_glu_kernel=True))
    off = fast_ops.op_table(DecodeOptions(pdl=False, situ_glu_kernel=True))
    by_kernel = {o.kernel: n for n, o in on.items()}
    for spec in registry.all_specs():
        name = by_kernel[spec.name]
        assert ("pdl" in on[name].launch) == spec.pdl, f"{spec.name}: pdl build {spec.pdl}, adapter options {on[name].launch}"
        if spec.pdl:
            assert on[name].launch["pdl"] is True and off[name].launch["pdl"] is False, name
        assert on[name].fn is off[name].fn and on[name].kernel == off[name].kernel == spec.name
    text = pdl_support()
    for kernel in PDL_KERNELS:
        assert kernel in text, f"pdl_support() does not say what {kernel} does"
