"""Planted defects (verify/defects.py) in the real fast path on an H100/H200 (sm_90a): each one, planted
before the executor captures its CUDA graphs as ``builtin:fast+defect=NAME`` does, changes the logits of
teacher-forced decode steps replayed from those graphs, on the seeded synthetic k3-sentinel (the architecture
the sentinel evals score) and k3-tiny; a second clean executor gives the clean one's logits bit for bit (so
any change is the defect's), every step ran on the fast path, and the defect counted its calls. Run:
python -m pytest -m gpu tests/test_defects_gpu.py -s (prints each defect's relative change)."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath.presets import preset
from k3_fastpath.runtime.executor import DecodeExecutor
from verify.checks.equivalence import build_synthetic_model
from verify.defects import DEFECTS, PlantedDefect

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]

STEPS = 6
MIN_MOVE = 1e-3  # relative logit change; the clean executor is bitwise reproducible (asserted below)


def _decode(ex: DecodeExecutor, ids: torch.Tensor, lens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [steps, B, V] of ``STEPS`` teacher-forced decode steps after a prefill, replayed from graphs."""
    ex.warmup_and_capture()
    cache = ex.new_cache(ids.shape[0])
    ex.prefill(ids, lens, cache)
    active = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    out = torch.stack([ex.decode(t, cache, active).float() for t in tokens])
    cache.release()
    return out


@pytest.mark.parametrize("name", ["k3-sentinel", "k3-tiny"])
def test_every_defect_moves_the_replayed_fast_steps_logits(name, seed):
    cfg = preset(name).config
    model = build_synthetic_model(cfg, 0, "stable", "cuda")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (4, 40), generator=g).cuda()
    lens = torch.tensor([40, 31, 17, 26]).cuda()
    tokens = torch.randint(3, cfg.vocab_size, (STEPS, 4), generator=g).cuda()
    clean_ex = DecodeExecutor(model, max_len=128, max_batch=4)
    clean = _decode(clean_ex, ids, lens, tokens)
    assert clean_ex.trace.summary()["fast_steps"] >= STEPS, clean_ex.trace.summary()
    again = _decode(DecodeExecutor(model, max_len=128, max_batch=4), ids, lens, tokens)
    assert torch.equal(again, clean)  # bitwise: any change below is the defect's
    moved = {}
    for d in DEFECTS:
        ex = DecodeExecutor(model, max_len=128, max_batch=4)
        planted = PlantedDefect(ex, d)
        out = _decode(ex, ids, lens, tokens)
        moved[d] = float((out - clean).norm() / clean.norm())
        assert planted.calls > 0 and ex.trace.summary()["fast_steps"] >= STEPS, (d, planted.calls)
        ex.close()
    print(f"\n{name}: relative logit change per planted defect: "
          + ", ".join(f"{d} {v:.3g}" for d, v in moved.items()))
    assert all(v > MIN_MOVE for v in moved.values()), moved
