"""Test helpers: vLLM's Kimi K3 cache layout for the reference model's caches, and vLLM's step metadata.

``VllmCaches`` allocates per-layer caches the way vLLM 0.32 does for K3 (shapes and dtypes from vLLM's own
``MambaStateShapeCalculator.kda_state_shape`` / ``MambaStateDtypeCalculator.kda_state_dtype``; MLA as a
paged ``[num_blocks, block_size, rank + rope]`` cache), and ``store`` / ``load`` move a reference ``K3Cache``
row into / out of them position by position (``kda_pages`` / ``mla_pages``: a layer's tensors in vLLM's shared
padded / interleaved pages), written independently of ``k3_fastpath.integrations.
vllm_state`` (per-position loops over the block table, explicit q|k|v packing), so the tests compare the
router's conversions against a second implementation. ``decode_metadata`` / ``prefill_metadata`` build the
per-layer metadata dict vLLM's forward context holds, from vLLM's real metadata classes.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from k3_fastpath.reference.kda import KDACache
from k3_fastpath.reference.mla import MLACache


def kda_pages(conv: torch.Tensor, state: torch.Tensor, pad: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``conv`` [N, W-1, 3C] and ``state`` [N, H, V, K] laid out as vLLM lays a KDA layer's cache: one
    raw page per state index holding the conv window, then the recurrent state, then ``pad`` bytes (vLLM pads
    hybrid pages to a common size), so both are strided views (index stride = the page, not their size)."""
    N = conv.shape[0]
    cb, sb = conv[0].numel() * conv.element_size(), state[0].numel() * state.element_size()
    page = cb + sb + pad
    raw = torch.full((N * page,), 0xFF, dtype=torch.uint8, device=conv.device)  # NaN bytes between
    c = raw.view(conv.dtype).as_strided(conv.shape, (page // 2, *conv.contiguous().stride()[1:]))
    st = raw.view(torch.float32).as_strided(state.shape, (page // 4, *state.contiguous().stride()[1:]), cb // 4)
    c.copy_(conv)
    st.copy_(state)
    return c, st


def mla_pages(latent: torch.Tensor) -> torch.Tensor:
    """A copy of a paged MLA cache ``[pages, page_size, D]`` whose pages lie two pages apart (NaN between), as
    vLLM's block-major layouts interleave the layers' pages: a strided view."""
    n, page, d = latent.shape
    buf = torch.full((n, 2 * page, d), float("nan"), dtype=latent.dtype, device=latent.device)
    buf[:, :page] = latent
    return buf[:, :page]


class VllmCaches:
    """vLLM-layout caches for ``num_indices`` KDA state indices and ``num_blocks`` MLA blocks."""

    def __init__(self, cfg, num_indices: int, num_blocks: int, block_size: int, model_dtype: torch.dtype, *,
                 num_spec: int = 0, ssm_dtype: str = "auto", dim_first: bool = False, seed: int = 0) -> None:
        from vllm.model_executor.layers.mamba import mamba_utils

        lac = cfg.linear_attn_config
        orig = mamba_utils.is_conv_state_dim_first
        mamba_utils.is_conv_state_dim_first = lambda: dim_first  # the VLLM_SSM_CONV_STATE_LAYOUT switch
        try:
            conv_shape, rec_shape = mamba_utils.MambaStateShapeCalculator.kda_state_shape(
                1, lac.num_heads, lac.head_dim, conv_kernel_size=lac.short_conv_kernel_size, num_spec=num_spec)
        finally:
            mamba_utils.is_conv_state_dim_first = orig
        conv_dt, rec_dt = mamba_utils.MambaStateDtypeCalculator.kda_state_dtype(model_dtype, "auto", ssm_dtype)
        g = torch.Generator().manual_seed(seed)
        self.cfg, self.block_size, self.dim_first = cfg, block_size, dim_first
        self.layers = []  # stand-ins for vLLM's attention modules: what the router reads is ``kv_cache``
        for i in range(cfg.num_hidden_layers):
            if cfg.is_kda_layer(i):  # garbage everywhere: a row the router does not own must not matter
                kv = (torch.randn((num_indices, *conv_shape), generator=g).to(conv_dt),
                      torch.randn((num_indices, *rec_shape), generator=g).to(rec_dt))
            else:
                kv = torch.randn((num_blocks, block_size, cfg.mla_latent_dim), generator=g).to(model_dtype)
            self.layers.append(SimpleNamespace(kv_cache=kv))

    def caches(self) -> list:
        return [layer.kv_cache for layer in self.layers]

    def _column(self, conv: torch.Tensor, index: int, col: int) -> torch.Tensor:
        """Column ``col`` (one past input, all 3C channels) of the conv window at ``index``."""
        return conv[index, :, col] if self.dim_first else conv[index, col]

    def store(self, ref, row: int, state_index: int, block_table: torch.Tensor, *, rec_index: int | None = None,
              offset: int = 0) -> None:
        """Reference cache row ``row`` -> vLLM's layout at ``state_index`` / through ``block_table``: the conv
        window at columns ``offset..`` of ``state_index``, the recurrent state at ``rec_index`` (default the
        same index), as a verify row with ``num_accepted_tokens = offset + 1`` reads them."""
        n = int(ref.lengths[row])
        rec_index = state_index if rec_index is None else rec_index
        for layer, src in zip(self.layers, ref.layers, strict=True):
            if isinstance(src, KDACache):
                conv, rec = layer.kv_cache
                packed = torch.cat([src.conv_q[row], src.conv_k[row], src.conv_v[row]], dim=1)  # [W-1, 3C]
                for j in range(packed.shape[0]):
                    self._column(conv, state_index, offset + j).copy_(packed[j])
                for h in range(rec.shape[1]):  # vLLM holds [V, K] per head, the reference [K, V]
                    rec[rec_index, h] = src.state[row, h].t()
            else:
                for p in range(n):
                    blk = int(block_table[p // self.block_size])
                    layer.kv_cache[blk, p % self.block_size] = src.latent[row, p]

    def load(self, ref, row: int, state_index: int, block_table: torch.Tensor, length: int, *,
             rec_index: int | None = None, offset: int = 0) -> None:
        """vLLM's layout -> reference cache row ``row`` (the inverse of ``store``), ``length`` tokens."""
        c = self.cfg.linear_attn_config.projection_dim
        rec_index = state_index if rec_index is None else rec_index
        for layer, dst in zip(self.layers, ref.layers, strict=True):
            if isinstance(dst, KDACache):
                conv, rec = layer.kv_cache
                packed = torch.stack([self._column(conv, state_index, offset + j) for j in range(dst.conv_q.shape[1])])
                dst.conv_q[row], dst.conv_k[row], dst.conv_v[row] = packed[:, :c], packed[:, c:2 * c], packed[:, 2 * c:]
                for h in range(rec.shape[1]):
                    dst.state[row, h] = rec[rec_index, h].t()
            else:
                assert isinstance(dst, MLACache)
                dst.latent[row].zero_()
                for p in range(length):
                    dst.latent[row, p] = layer.kv_cache[int(block_table[p // self.block_size]), p % self.block_size]
        ref.lengths[row] = length


def decode_metadata(kda_name: str, mla_name: str, state_indices, seq_lens, block_table: torch.Tensor, *,
                    num_prefills: int = 0, num_spec: int = 0, block_size: int | None = None) -> dict:
    """The forward context's ``attn_metadata`` of a decode step (plus ``num_prefills`` prefill requests of one
    token each, or ``num_spec`` speculative requests), built from vLLM's metadata classes. ``block_size``: the
    slot mapping is vLLM's (each new token's ``block * block_size + offset``, -1 for a state index <= 0, a
    padded row), else zeros."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata, MLACommonMetadata
    from vllm.models.kimi_k3.nvidia.kda_metadata import KimiK3KDAMetadata

    b = len(state_indices)
    n = b + num_prefills + num_spec
    seq = torch.as_tensor(seq_lens, dtype=torch.int32)
    kda = KimiK3KDAMetadata(num_prefills=num_prefills, num_prefill_tokens=num_prefills, num_decodes=b,
                            num_decode_tokens=b, num_spec_decodes=num_spec, num_spec_decode_tokens=2 * num_spec,
                            num_actual_tokens=n, non_spec_state_indices_tensor=torch.as_tensor(state_indices))
    slots = torch.zeros(n, dtype=torch.long)
    if block_size is not None:
        for r in range(b):
            p = int(seq[r]) - 1
            real = int(state_indices[r]) > 0
            slots[r] = int(block_table[r, p // block_size]) * block_size + p % block_size if real else -1
    mla = MLACommonMetadata(num_reqs=n, max_query_len=1, max_seq_len=int(seq.max()), num_actual_tokens=n,
                            query_start_loc=torch.arange(n + 1, dtype=torch.int32), slot_mapping=slots,
                            num_decodes=b, num_decode_tokens=b, num_prefills=num_prefills,
                            decode=MLACommonDecodeMetadata(block_table=block_table, seq_lens=seq,
                                                           dcp_tot_seq_lens=None))
    return {kda_name: kda, mla_name: mla}


def every_layer(meta: dict, cfg, names: list[str], groups: dict[int, dict] | None = None) -> dict:
    """The forward context's metadata keyed by every layer's name (``names[i]``: layer i), as vLLM holds it: each
    KDA layer the KDA entry of ``meta``, each MLA layer its MLA entry, unless ``groups`` gives a layer another
    metadata dict (``groups[i]``: a cache group of its own, with its own indices)."""
    kda, mla = (next(v for v in meta.values() if hasattr(v, k)) for k in ("non_spec_state_indices_tensor", "decode"))
    out = {}
    for i, n in enumerate(names):
        src = (groups or {}).get(i)
        if cfg.is_kda_layer(i):
            out[n] = kda if src is None else next(v for v in src.values() if hasattr(v, "non_spec_state_indices_tensor"))
        else:
            out[n] = mla if src is None else next(v for v in src.values() if hasattr(v, "decode"))
    return out


def verify_metadata(kda_name: str, mla_name: str, blocks: torch.Tensor, accepted, query_lens, seq_lens,
                    block_table: torch.Tensor, *, num_prefills: int = 0) -> dict:
    """The ``attn_metadata`` of a step of verify rows (vLLM with ``num_speculative_tokens = k``: every decode
    row is one): request r feeds ``query_lens[r]`` tokens, its KDA state blocks ``blocks[r]`` (k + 1), vLLM's
    ``num_accepted_tokens`` of its last verify step ``accepted[r]``, ``seq_lens[r]`` including this step's
    tokens; plus ``num_prefills`` one-token prefills after them (such a step is not routed)."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata, MLACommonMetadata
    from vllm.models.kimi_k3.nvidia.kda_metadata import KimiK3KDAMetadata

    b = len(query_lens)
    q = torch.as_tensor(query_lens, dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), q.cumsum(0).to(torch.int32)])
    n_spec = int(qsl[-1])
    n = n_spec + num_prefills
    seq = torch.as_tensor(seq_lens, dtype=torch.int32)
    kda = KimiK3KDAMetadata(num_prefills=num_prefills, num_prefill_tokens=num_prefills, num_decodes=0,
                            num_decode_tokens=0, num_spec_decodes=b, num_spec_decode_tokens=n_spec,
                            num_actual_tokens=n, spec_query_start_loc=qsl,
                            spec_state_indices_tensor=torch.as_tensor(blocks, dtype=torch.int32),
                            num_accepted_tokens=torch.as_tensor(accepted, dtype=torch.int32))
    mla = MLACommonMetadata(num_reqs=b + num_prefills, max_query_len=int(q.max()), max_seq_len=int(seq.max()),
                            num_actual_tokens=n, query_start_loc=torch.cat([qsl, qsl[-1] + torch.arange(
                                1, num_prefills + 1, dtype=torch.int32)]), slot_mapping=torch.zeros(n),
                            num_decodes=b, num_decode_tokens=n_spec, num_prefills=num_prefills,
                            decode=MLACommonDecodeMetadata(block_table=block_table, seq_lens=seq,
                                                           dcp_tot_seq_lens=None))
    return {kda_name: kda, mla_name: mla}


def vllm_language_model(cfg, state_dict: dict) -> torch.nn.Module:
    """A module whose named parameters are our checkpoint's tensors the way vLLM's K3 language model holds them
    after loading (fused row blocks, stacked experts, ``A_log`` cut to the real heads, ``o_norm`` in BF16), built
    by concatenation here; the real class's names and values: tests/integration/test_vllm_k3_checkpoint.py."""
    import re

    from k3_fastpath.integrations.vllm_weights import EXPERTS, FUSED

    sd = {k.removeprefix("language_model."): v for k, v in state_dict.items()}
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for vname, parts in FUSED.items():
            owner = vname.rsplit(".", 2)[0]
            names = [f"{p}{owner}.{s}.weight" for s in parts]
            if all(n in sd for n in names):
                out[p + vname] = torch.cat([sd[n] for n in names])
                used.update(names)
        base = f"{p}block_sparse_moe.experts"
        if f"{base}.0.w1.weight_packed" in sd:
            for vname, parts in EXPERTS.items():
                rows = [[f"{base}.{e}.{s}" for s in parts] for e in range(cfg.num_experts)]
                out[f"{base}.routed_experts.{vname}"] = torch.stack([torch.cat([sd[n] for n in r]) for r in rows])
                used.update(n for r in rows for n in r)
    heads = cfg.linear_attn_config.num_heads
    for n, t in sd.items():
        if n in used:
            continue
        out[n] = t[:heads].clone() if n.endswith("A_log") else (
            t.to(torch.bfloat16) if n.endswith("o_norm.weight") else t)
    root = torch.nn.Module()
    for name, t in out.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    assert not re.search(r"experts\.\d+\.", " ".join(out)), "every expert tensor is stacked"
    return root


def stand_in_vllm_k3(monkeypatch, vc: VllmCaches, hidden_size: int, model=None) -> tuple[list, SimpleNamespace]:
    """Stand in for what vLLM's K3 model class builds and reads on a GPU: its base constructor builds a
    language model over ``vc``'s layers (named as vLLM names them) whose ``forward`` appends its keyword
    arguments to ``calls`` and returns ``"vllm hidden"``, and whose ``compute_logits`` is ``model``'s (the
    final norm, then lm_head, as vLLM's K3 one; FP32 here) on a tensor, ``"vllm logits of <h>"`` on
    anything else; the forward context is ``context`` (set ``context.attn_metadata`` per step). Returns
    ``(calls, context)``."""
    import vllm.forward_context as fc
    from vllm.models.kimi_k3 import KimiK3ForConditionalGeneration as Base

    for i, layer in enumerate(vc.layers):
        layer.prefix = layer.layer_name = f"language_model.model.layers.{i}.self_attn"
    calls: list = []

    class LanguageModel(torch.nn.Module):  # stands in for vLLM's KimiLinearForCausalLM
        def __init__(self):
            super().__init__()
            self.model = SimpleNamespace(layers=[SimpleNamespace(self_attn=a) for a in vc.layers])

        def forward(self, **kw):
            calls.append(kw)
            return "vllm hidden"

        def compute_logits(self, hidden):
            if not isinstance(hidden, torch.Tensor):
                return f"vllm logits of {hidden}"
            with torch.no_grad():
                return model.compute_logits(hidden)

    def stand_in(self, vllm_config, prefix=""):
        torch.nn.Module.__init__(self)
        self.language_model = LanguageModel()
        self.config = SimpleNamespace(text_config=SimpleNamespace(hidden_size=hidden_size))

    monkeypatch.setattr(Base, "__init__", stand_in)
    context = SimpleNamespace(attn_metadata=None)
    monkeypatch.setattr(fc, "get_forward_context", lambda: context)
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    return calls, context


def route_vllm_config(*, dtype: torch.dtype, max_len: int, max_num_seqs: int, block_size: int, spec=None,
                      model: str | None = None, **extra) -> SimpleNamespace:
    """The fields of a ``VllmConfig`` the route's model class reads, for ``decode_backend:
    latency_specialized`` (``extra``: more ``additional_config`` keys; ``spec``: the speculative config)."""
    mc = SimpleNamespace(enforce_eager=True, max_model_len=max_len, dtype=dtype,
                         architectures=["KimiK3ForConditionalGeneration"])
    if model is not None:
        mc.model = model
    return SimpleNamespace(additional_config={"decode_backend": "latency_specialized", **extra}, model_config=mc,
                           scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
                           cache_config=SimpleNamespace(cache_dtype="auto", block_size=block_size),
                           speculative_config=spec)
