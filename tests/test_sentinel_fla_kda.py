"""The sentinel's training through ``fla_kda_chunked`` on a CPU, with a stand-in for fla's ``chunk_kda``
that behaves as fla's autograd Function does where it matters here: it saves ``initial_state`` for its
backward (and recomputes through ``reference.kda.kda_chunked``). The layer updates its cache state in place
after the recurrence; the wrapper must hand fla a copy, or the backward finds its saved tensor modified (the
failure of step 0 on the H200, bundles/runs/2026-12-04-h200-session17). fla's own numerics against the
reference: tests/test_sentinel_fla_kda_interpreted.py (CPU) and tests/test_sentinel_fla_kda_gpu.py."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from k3_fastpath.reference.kda import kda_chunked
from k3_fastpath.sentinel import fla_kda
from k3_fastpath.sentinel import train as sentinel_train

PLAN = sentinel_train.TrainPlan(preset="k3-tiny", steps=2, batch=2, seq_len=384, warmup=1, mrcr_chars=300,
                                mrcr_needles=(2,), heldout_items=0)


class _ChunkKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0):
        ctx.save_for_backward(q, k, v, g, beta, h0)  # as fla's ChunkKDAFunction saves initial_state
        with torch.no_grad():
            return kda_chunked(q, k, v, g, beta, h0)

    @staticmethod
    def backward(ctx, do, dht):
        saved = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]  # raises if h0 changed in place
        with torch.enable_grad():
            o, ht = kda_chunked(*saved)
        return torch.autograd.grad((o, ht), saved, (do, dht), allow_unused=True)


@pytest.fixture
def fake_fla(monkeypatch):
    calls = []

    def chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size):
        assert scale == 1.0 and output_final_state
        calls.append(initial_state)
        return _ChunkKDA.apply(q, k, v, g, beta, initial_state)

    mods = {name: types.ModuleType(name) for name in ("fla", "fla.ops", "fla.ops.kda")}
    mods["fla.ops.kda"].chunk_kda = chunk_kda
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(fla_kda, "fla_unavailable_reason", lambda device: None)
    return calls


def test_training_through_the_fla_wrapper_survives_the_cache_update(tmp_path, fake_fla):
    rec = sentinel_train.train(dataclasses.replace(PLAN, kda="fla"), tmp_path / "fla", "cpu", log=lambda _: None)
    assert rec["kda_impl"] == "fla" and rec["steps_done"] == 2 and fake_fla
    ref = sentinel_train.train(dataclasses.replace(PLAN, kda="reference"), tmp_path / "ref", "cpu", log=lambda _: None)
    # the stand-in computes the reference's recurrence: the same training, step for step
    for a, b in zip(rec["loss_curve"], ref["loss_curve"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_the_stand_in_catches_a_state_modified_after_the_call(fake_fla):
    """The control: without the wrapper's copy, the layer's in-place cache update breaks the backward."""
    from fla.ops.kda import chunk_kda

    b, t, h, d = 1, 8, 2, 4
    q, k, v = (torch.randn(b, t, h, d, requires_grad=True) for _ in range(3))
    g = (-torch.rand(b, t, h, d)).requires_grad_(True)
    beta = torch.rand(b, t, h).requires_grad_(True)
    state = torch.zeros(b, h, d, d)
    o, final = chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=state, output_final_state=True, chunk_size=64)
    state.copy_(final.detach())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()



# ---------------------------------------------------------------- pinned configs (no Triton autotuning)
def _tuned_module(monkeypatch, name: str):
    """A module with two autotuned Triton kernels as fla declares them (one under ``heuristics``, one with
    an ``early_config_prune``), registered as ``name``."""
    triton = pytest.importorskip("triton", reason="needs Triton (fla's kernels and their autotuner)")
    import triton.language as tl

    configs = [triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
               for bk in (32, 64, 128) for bv in (32, 64) for w in (2, 4, 8) for s in (2, 3, 4)]

    def no_128(configs, nargs, **kw):
        return [c for c in configs if c.kwargs["BK"] != 64]  # the shape rules out BK 64 for this call

    @triton.heuristics({"EVEN": lambda args: True})
    @triton.autotune(configs=configs, key=["n"])
    @triton.jit
    def kernel_a(x, n, BK: tl.constexpr, BV: tl.constexpr, EVEN: tl.constexpr):
        pass

    @triton.autotune(configs=configs, key=["n"], prune_configs_by={"early_config_prune": no_128})
    @triton.jit
    def kernel_b(x, n, BK: tl.constexpr, BV: tl.constexpr):
        pass

    mod = types.ModuleType(name)
    mod.kernel_a, mod.kernel_b = kernel_a, kernel_b
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_pinning_leaves_one_config_per_call_chosen_by_the_rule(monkeypatch):
    mod = _tuned_module(monkeypatch, "fla.ops.k3_test_kernels")
    pinned = fla_kda.PinnedConfigs()
    monkeypatch.setattr(fla_kda, "PINNED", pinned)
    tuners = fla_kda.autotuners(("fla.ops.k3_test_kernels",))
    assert len(tuners) == 2  # the heuristics wrapper is looked through
    assert fla_kda.pin_fla_configs(("fla.ops.k3_test_kernels",)) == 2
    a, b = tuners
    for t in tuners:
        t.nargs = {}
        assert len(t.configs) == 54  # Triton still sees many configs, so its pruning runs per call
    (ca,) = a.prune_configs({})
    assert (ca.kwargs, ca.num_warps, ca.num_stages) == ({"BK": 64, "BV": 64}, 4, 2)
    (cb,) = b.prune_configs({})  # the kernel's own pruning applies first: BK 64 is not offered
    assert cb.kwargs["BV"] == 64 and cb.kwargs["BK"] in (32, 128) and cb.num_warps == 4 and cb.num_stages == 2
    assert set(pinned.used) == {"kernel_a", "kernel_b"} and "BK: 64" in pinned.used["kernel_a"]
    fla_kda.pin_fla_configs(("fla.ops.k3_test_kernels",))  # pinning twice wraps once
    assert len(b.prune_configs({})) == 1
    pinned.unpin_all()  # autotuning back: Triton's own pruning, every config offered
    assert len(a.prune_configs({})) == 54 and not hasattr(a, "_k3_pinned") and pinned.tuners == []
    del mod


def test_the_rule_is_what_the_pinning_uses():
    """The control: a different rule picks a different config, so the assertion above can fail."""
    triton = pytest.importorskip("triton", reason="needs Triton (fla's kernels and their autotuner)")
    configs = [triton.Config({"BK": bk}, num_warps=w, num_stages=2) for bk in (32, 64) for w in (2, 4)]
    assert fla_kda.PinnedConfigs.choose(configs).kwargs == {"BK": 64}
    assert fla_kda.PinnedConfigs.choose(list(reversed(configs))).num_warps == 4
    assert fla_kda.PinnedConfigs.choose(configs[:2]).kwargs == {"BK": 32}


def test_a_pick_that_does_not_fit_the_gpu_is_dropped_and_the_rule_picks_again(monkeypatch):
    """Triton raises OutOfResources when it loads a kernel whose config needs more shared memory than the
    GPU has (before anything runs): the pinned tuner drops that config and the rule picks the next."""
    mod = _tuned_module(monkeypatch, "fla.ops.k3_test_oor")  # skips first where Triton is missing
    from triton.runtime.errors import OutOfResources

    pinned = fla_kda.PinnedConfigs()
    monkeypatch.setattr(fla_kda, "PINNED", pinned)
    tuner = fla_kda.autotuners(("fla.ops.k3_test_oor",))[0]
    launched = []

    class Kernel:  # stands in for the JIT function: loading a BV 64 config exceeds shared memory
        __name__ = "kernel_oor"

        def run(self, *args, **kw):
            if kw["BV"] == 64:
                raise OutOfResources(294912, 232448, "shared memory")
            launched.append((kw["BK"], kw["BV"]))
            return "ran"

    tuner.fn = Kernel()
    fla_kda.pin_fla_configs(("fla.ops.k3_test_oor",))
    assert tuner.run(None, 7) == "ran" and launched == [(64, 32)]
    assert pinned.used == {"kernel_oor": str(tuner.best_config)} and "BV: 32" in pinned.used["kernel_oor"]
    # tried at 2 stages: BK 64 / BV 64 at 4, 2 and 8 warps, then BK 32 / BV 64 at 4 warps (the same
    # blocks and warps at more stages are not tried: they need at least the shared memory that did not fit)
    skipped = pinned.skipped["kernel_oor"]
    assert len(skipped) == 4 and all("BV: 64" in c and "num_stages: 2" in c for c in skipped)
    assert [c.split(", ")[2] for c in skipped] == ["num_warps: 4", "num_warps: 2", "num_warps: 8", "num_warps: 4"]
    assert tuner.run(None, 7) == "ran" and len(pinned.skipped["kernel_oor"]) == 4  # not retried
    del mod
