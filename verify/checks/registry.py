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
       requires=("cuda", "sm90", "cutlass"),
       params={"batches": [1, 8], "contexts": ["short"], "steps": 64, "preset": "auto", "conditioning": "stable",
               "prompt_len": 16, "top_k": 5, "max_mean_kl": 0.01, "kv_cache": "bf16", "use_graphs": True,
               "reference_dense_experts": "auto", "max_later_violation_rate": 0.002, "executor_options": None}),
    _d("perf.bandwidth_probe", "perf", "bandwidth_probe",
       "the GPU's measured HBM read bandwidth and bf16 matmul rate (the floor every perf number is divided by)",
       requires=("cuda",), params={"bytes": 4 << 30}),
    _d("bench.kernels", "bench", "kernels",
       "each kernel vs cuBLAS / PyTorch: CUDA-graph medians, cold L2, % of the HBM floor, issue #3 targets",
       requires=("cuda", "sm90", "cutlass"),
       params={"presets": ["k3-tp8-rank", "k3-tp16-rank"], "ms": [1, 2, 4, 8, 16, 32, 64], "sweep": False,
               "sweep_shapes": None, "parts": None}),
    _d("perf.decode_sweep", "perf", "decode_sweep",
       "decode step time, fast vs standard, batch x context x TP x routing, against the HBM floor; issue #5 targets",
       requires=("cuda", "sm90", "cutlass"),
       params={"batches": [1], "contexts": [1024], "tp": [1], "routing": ["uniform", "real"], "mixed": True,
               "preset": "k3-mini", "iters": 20, "standard_iters": 5, "warmup": 3, "kv_cache": "bf16",
               "mixed_batches": [1, 8], "mixed_prefill_tokens": 256, "mixed_max_context": 4096,
               "standard_graph": True, "reference_batches": None, "layer_times": True,
               "standard_compiled_glue": False, "fast_variants": None,
               "single_expert_copy": False, "tp_fast_pdl": False, "kernel_profile": False}),
    # features.*: through the run's engines (--engine vs --baseline-engine); on a CPU builtin:reference
    _d("features.structured_output", "features", "structured_output",
       "JSON-schema / regex / choice constrained outputs all validate (100%), engine under test and baseline",
       params={"temperatures": [0.0, 1.0], "samples": 2, "max_tokens": 256, "cases": None}),
    _d("features.temperature_sampling", "features", "temperature_sampling",
       "sampled token frequencies match softmax(logits/T) with top-k/top-p (G-test, Bonferroni); seeds reproduce",
       params={"temperatures": [0.5, 1.0, 1.5], "filters": None, "samples": 2000, "alpha": 1e-3,
               "min_expected": 5.0, "prompt_len": 12, "logit_tol": 0.05, "mass_tol": 0.005, "seq_tokens": 8,
               "other_seeds": 3}),
    _d("features.full_context", "features", "full_context",
       "a request at the full configured context succeeds and matches the baseline; one token over is rejected",
       params={"max_tokens": 4, "top_logprobs": 5, "max_model_len": None}),
    # evals.*: lm-eval tasks from evals/ on the run's engines (--engine vs --baseline-engine), paired gates from
    # evals/thresholds.yaml; data from data_dir, $K3_EVAL_DATA_DIR or the offline HF cache ("synthetic": made-up)
    _d("evals.gsm8k", "evals", "gsm8k",
       "GSM8K through lm-eval, engine under test vs baseline in the same run (paired: McNemar, bootstrap)",
       params={"limit": None, "max_tokens": None, "data_dir": None, "thresholds": None}),
    _d("evals.aime25", "evals", "aime25",
       "AIME25 through lm-eval with sampled repeats, per-problem means paired (bootstrap) vs baseline",
       params={"limit": None, "repeats": 8, "max_tokens": None, "data_dir": None, "thresholds": None}),
    _d("evals.mrcr", "evals", "mrcr",
       "MRCR 2/4/8 needles through lm-eval (prefix + SequenceMatcher), paired bootstrap vs baseline",
       params={"limit": None, "needles": [2, 4, 8], "max_tokens": None, "data_dir": None, "thresholds": None}),
]

REGISTRY: dict[str, CheckDecl] = {d.id: d for d in _DECLS}
