"""fla's ``chunk_kda`` run on the CPU through Triton's interpreter, against ``reference.kda.kda_chunked`` in FP64.

Run as a script in its own process (``TRITON_INTERPRET=1`` must be set before Triton decorates fla's kernels,
and an fla imported earlier in a process keeps compiled kernels): ``python tests/fla_interpreted.py CASES``
with ``CASES`` a JSON list of ``[T, pad, beta_scale]``; prints one JSON object: per case the relative error
(``max |fla - ref| / max |ref|``) of the output, the final state and the six input gradients, and the configs
the pinned kernels took (``fla_kda.PINNED.used``). ``beta_scale`` != 1 feeds the reference a scaled beta:
the control that shows the comparison can fail.

The same wrapper (``fla_kda.fla_kda_chunked``) and config pinning (``fla_kda.pin_fla_configs``) training runs
on the GPU, over the config lists fla builds on a Hopper GPU (``_as_hopper``: fla reads the GPU's shared memory
and name at import; here it is told an H100's), so each kernel runs the block sizes and stages training picks
on an H100 / H200 (the test compares them with a GPU run's record). This holds the recurrence and our
contract with it (log decay, beta after its sigmoid, scale 1, the initial state and its gradient) at those
configs; TF32 dots and the hardware itself stay with ``test_sentinel_fla_kda_gpu.py``.

The interpreter as ``tests/triton_interpreter.py`` sets it up (one adaptation: tensor loop variables).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton_interpreter import interpret  # noqa: E402

interpret()  # before torch / fla import any Triton kernel

import torch  # noqa: E402
from kda_chunk_tools import chunk_inputs, rel_err, run_with_grads  # noqa: E402

B, H, D = 1, 2, 128  # one sequence of two heads at the sentinel's (K3's) head dim
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dstate")


def compare(t: int, pad: int, beta_scale: float) -> dict[str, float]:
    from k3_fastpath.reference.kda import kda_chunked
    from k3_fastpath.sentinel.fla_kda import fla_kda_chunked

    inputs = chunk_inputs(B, t, H, D, seed=t + pad, pad=pad)
    gen = torch.Generator().manual_seed(7)
    weights = (torch.randn(B, t, H, D, generator=gen), torch.randn(B, H, D, D, generator=gen))

    def reference(q, k, v, g_log, beta, state):
        return kda_chunked(q.double(), k.double(), v.double(), g_log.double(), beta.double() * beta_scale,
                           state.double())

    fla = run_with_grads(fla_kda_chunked, inputs, weights)
    ref = run_with_grads(reference, inputs, weights)
    if not all(torch.isfinite(x).all() for x in fla):
        return {"nonfinite": 1.0}
    return {n: rel_err(f, r) for n, f, r in zip(NAMES, fla, ref, strict=True)}


HOPPER_SMEM = 232448  # fla's Backend.HOPPER: an H100's (and H200's) opt-in shared memory per block, bytes


def _as_hopper() -> None:
    """Make fla build its config lists as on a Hopper GPU (before ``fla.ops`` is imported: the lists are made
    at import): its shared-memory query answers ``HOPPER_SMEM``, ``IS_NVIDIA_HOPPER`` is set."""
    import fla.utils
    import fla.utils.hardware as hw

    hw.get_all_max_shared_mem = lambda: [HOPPER_SMEM]
    hw.check_shared_mem.cache_clear()
    hw.IS_NVIDIA_HOPPER = fla.utils.IS_NVIDIA_HOPPER = True


def main(cases: list[list[float]]) -> dict:
    _as_hopper()
    import fla.ops.kda  # noqa: F401  (every kernel chunk_kda launches)

    from k3_fastpath.sentinel.fla_kda import PINNED, pin_fla_configs

    pinned = pin_fla_configs()
    errors = [compare(int(t), int(pad), float(scale)) for t, pad, scale in cases]
    return {"pinned": pinned, "errors": errors, "configs": dict(PINNED.used)}


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps(main(json.loads(sys.argv[1]))))
