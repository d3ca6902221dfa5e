"""Every check ``k3-verify`` knows, declared without importing the heavy modules that implement it.

A check is a function ``fn(ctx: CheckContext, **params) -> CheckResult`` in ``verify/checks/<module>.py``.
Its declaration says what it needs (``requires``): the runner turns an unmet need into a ``skipped``
result whose reason names it ("needs a CUDA device"), so a CPU run lists GPU checks as skipped instead of
pretending. A declared check whose implementation has not landed yet returns ``error`` wherever its
requirements are met: a missing implementation is never a pass and never a quiet skip.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CheckDecl:
    id: str
    module: str  # verify.checks.<module>
    function: str
    description: str
    requires: tuple[str, ...] = ()
    params: dict[str, object] = field(default_factory=dict)  # allowed parameters with defaults
    implemented: bool = True
    issue: str = ""  # where the missing implementation is tracked


def _d(id: str, module: str, function: str, description: str, requires=(), params=None, implemented=True,
       issue="") -> CheckDecl:
    return CheckDecl(id, module, function, description, tuple(requires), dict(params or {}), implemented, issue)


_DECLS = [
    _d("reference.prefill_decode_consistency", "reference", "prefill_decode_consistency",
       "step-by-step decode logits equal prefill logits at every position (KDA, MLA, whole model; ragged batches)",
       params={"batches": [1, 3], "ragged": True, "decode_steps": 6, "prompt_len": 12}),
    _d("reference.determinism", "reference", "determinism",
       "two identical runs give bitwise identical logits and tokens; another seed gives different ones",
       params={"batch": 2, "prompt_len": 10, "decode_steps": 4}),
    _d("weights.roundtrip", "weights", "roundtrip",
       "synthetic checkpoint -> load -> identical tensors; MXFP4 against an independent decoder; TP slices reassemble",
       params={"tp_sizes": [2, 4]}),
    _d("kernels.compile", "kernels", "compile_all",
       "every CuTe DSL kernel compiles for sm_90a at every decode shape of the presets",
       requires=("cutlass",), params={"presets": ["k3-tp8-rank", "k3-tp16-rank"]}),
    _d("kernels.numerics", "kernels", "numerics",
       "every fast kernel vs the FP64 reference on an H200, launch counters asserted, bitwise repeat",
       requires=("cuda", "sm90", "cutlass"), params={}),
    _d("kernels.sanitizer", "kernels", "sanitizer",
       "compute-sanitizer memcheck/racecheck/synccheck/initcheck clean on small shapes of every kernel",
       requires=("cuda", "sm90", "cutlass", "compute-sanitizer"), params={"tools": ["memcheck"]}),
    _d("equivalence.decode", "equivalence", "decode",
       "fast path vs reference: greedy tokens side by side, top-5 at first divergence, logit error, no fallback",
       requires=("cuda", "sm90", "cutlass"), params={"batches": [1, 8], "contexts": ["short"], "steps": 64},
       implemented=False, issue="#5 (the fast decode path end to end)"),
    _d("perf.bandwidth_probe", "perf", "bandwidth_probe",
       "the GPU's measured HBM read bandwidth and bf16 matmul rate (the floor every perf number is divided by)",
       requires=("cuda",), params={"bytes": 4 << 30}),
    _d("bench.kernels", "bench", "kernels",
       "each kernel vs cuBLAS / PyTorch: CUDA-graph medians, cold L2, % of the HBM floor, issue #3 targets",
       requires=("cuda", "sm90", "cutlass"),
       params={"presets": ["k3-tp8-rank", "k3-tp16-rank"], "ms": [1, 2, 4, 8, 16, 32, 64], "sweep": False}),
    _d("perf.decode_sweep", "perf", "decode_sweep",
       "decode step time, fast vs standard, batch x context x TP, against the HBM floor",
       requires=("cuda", "sm90", "cutlass"), params={"batches": [1], "contexts": [1024], "tp": [1]},
       implemented=False, issue="#5 (the fast decode path end to end)"),
    _d("features.structured_output", "features", "structured_output",
       "JSON-schema / regex / choice constrained outputs all validate, fast path vs reference",
       requires=("cuda",), params={}, implemented=False, issue="#6 (features and evals through real engines)"),
    _d("features.temperature_sampling", "features", "temperature_sampling",
       "sampled token frequencies match softmax(logits/T); same seed same tokens",
       requires=("cuda",), params={"temperatures": [1.0]}, implemented=False,
       issue="#6 (features and evals through real engines)"),
    _d("features.full_context", "features", "full_context",
       "a request at the full configured context succeeds and matches; one token over is rejected",
       requires=("cuda",), params={}, implemented=False, issue="#6 (features and evals through real engines)"),
    _d("evals.gsm8k", "evals", "gsm8k", "GSM8K through lm-eval, fast path vs baseline in the same run (paired)",
       requires=("cuda",), params={"limit": None}, implemented=False,
       issue="#6 (features and evals through real engines)"),
    _d("evals.aime25", "evals", "aime25", "AIME25 with repeats, fast path vs baseline (paired)",
       requires=("cuda",), params={"repeats": 8}, implemented=False,
       issue="#6 (features and evals through real engines)"),
    _d("evals.mrcr", "evals", "mrcr", "MRCR 2/4/8 needles, fast path vs baseline (paired)",
       requires=("cuda",), params={"needles": [2, 4, 8]}, implemented=False,
       issue="#6 (features and evals through real engines)"),
]

REGISTRY: dict[str, CheckDecl] = {d.id: d for d in _DECLS}
