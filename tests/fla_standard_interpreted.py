"""The standard path's KDA step through fla (what it runs on a GPU: fla's ``fused_recurrent_kda_fwd`` and
``rms_norm_gated``), run on the CPU through Triton's interpreter, against the same step's PyTorch path.

Run as a script in its own process (``tests/triton_interpreter.py``): prints one JSON object with, for a
decode step and a verify step (``standard_verify.kda_verify_standard``: fla's speculative layout, 2-D
``ssm_state_indices``), the relative error of the outputs and of every pool (conv windows, states) the step
leaves, fla against PyTorch. ``standard_ops.fla_for`` is made to hand fla to a CPU step (on a GPU it does so
for CUDA steps). FP32 tensors throughout: the interpreter's BF16 is not the GPU's (``triton_interpreter``).
``--wrong-layout`` hands fla each sequence's states transposed ([K, V] -> [V, K]): the control.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton_interpreter import interpret  # noqa: E402

interpret()

import torch  # noqa: E402

H, D, S = 2, 128, 24  # heads of K3's head dim, pool slots


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _step(seed: int, tokens: int, wrong_layout: bool) -> dict[str, float]:
    from k3_fastpath.runtime import standard_ops

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g)

    c = H * D
    slot = torch.tensor([3, 0, 7, 1], dtype=torch.int32)  # a padded row (slot 0) among real ones
    b = slot.shape[0]
    rows = b * tokens
    q, k, v, gate, a = (rnd(rows, c) for _ in range(5))
    beta_logits = rnd(rows, H)
    weights = [rnd(c, 4, scale=0.5) for _ in range(3)]
    A_log, dt_bias, o_norm_w = rnd(H, scale=0.5), rnd(c, scale=0.5), 1 + rnd(D, scale=0.1)
    pools = [rnd(S, 3, c) for _ in range(3)] + [rnd(S, H, D, D, scale=0.1)]
    kw = {"eps": 1e-5, "lower_bound": -5.0}
    if tokens > 1:  # each token's window and state at its own slot (padded rows' tokens at slot 0)
        out = torch.tensor([0 if slot[i // tokens] == 0 else 4 + i for i in range(rows)], dtype=torch.int32)
        kw |= {"slot_out": out, "tokens": tokens}
    runs = {}
    for name in ("torch", "fla"):
        mine = [p.clone() for p in pools]
        fla = standard_ops.fla_kda() if name == "fla" else None
        standard_ops.fla_for = lambda device, fla=fla: fla
        if name == "fla" and wrong_layout:
            mine[3] = mine[3].transpose(-1, -2).contiguous()
        y = standard_ops.kda_step_standard(q, k, v, gate, a, beta_logits, *weights, A_log, dt_bias, o_norm_w, slot,
                                           *mine, **kw)
        if name == "fla" and wrong_layout:
            mine[3] = mine[3].transpose(-1, -2)
        runs[name] = [y, *mine]
    names = ("y", "conv_q", "conv_k", "conv_v", "state")
    return {n: _rel(f, t) for n, f, t in zip(names, runs["fla"], runs["torch"], strict=True)}


def main(wrong_layout: bool) -> dict:
    from k3_fastpath.runtime import standard_ops

    if standard_ops.fla_kda() is None:
        raise SystemExit("fla is not importable")
    from k3_fastpath.sentinel.fla_kda import pin_fla_configs

    pin_fla_configs()  # one config per autotuned kernel: the interpreter cannot time anything
    return {"decode": _step(1, 1, wrong_layout), "verify": _step(2, 3, wrong_layout)}


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps(main("--wrong-layout" in sys.argv[1:])))
