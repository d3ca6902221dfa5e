"""A mixed step: decode rows and one sequence's prefill in one model pass, as a serving engine's chunked-prefill
step runs it, on the executor's slot pools, eager or captured in a CUDA graph.

The step's stream has ``N = Bk + P`` rows: the decode bucket's ``Bk`` rows (one token each; padded and
inactive rows on the empty slot 0, as in a decode step) followed by the ``P`` prompt tokens of the
prefilling sequence, which continues its slot from position ``start``. Everything but attention is
token-parallel and runs on all ``N`` rows through the op table (``fast_step.step_sections``: embedding,
AttnRes mixes and norms, projections, router, routed and shared experts); attention splits the rows
(``_kda_mixed`` / ``_mla_mixed``): the decode rows through ``kda_step`` / ``mla_attention`` on their
slots, the prompt through ``kda_prefill`` / ``mla_prefill`` (``standard_prefill.py``: fla's chunked KDA,
SDPA over the up-projected latents) on the prefilling slot. Only ``Bk`` rows reach the final mix and
``lm_head``: each decode row's, with the prefilling sequence's row taking its LAST prompt token's logits
(what a server samples from), so ``logits [Bk, V]`` is laid out like a decode step's.

The op table is the standard path's (``standard_ops.standard_op_table`` plus the two prefill ops): a mixed
step is outside the fast path's envelope (``envelope.PREFILL_REASON``), so the ``latency_specialized``
executor serves it with this same step and records the fallback. ``MixedStepRunner`` keeps one
``MixedIO`` per (bucket, P, start) and, on a GPU, one CUDA graph per key, captured after one eager warm-up
(fla's Triton kernels compile and autotune there); a key whose capture fails runs eagerly, with the error
kept in ``eager_keys``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .fast_ops import OpImpl, mla_step_index
from .fast_step import OpCalls, SideStream, step_sections
from .step_plan import KDAWeights, LayerPlan, MLAWeights, ModelPlan

MixedKey = tuple[int, int, int]  # (decode bucket, prompt tokens P, start position of the prompt)


@dataclass
class MixedIO:
    """The static tensors of one mixed step shape. Duck-typed as the ``StepIO`` that ``step_sections`` reads:
    ``tokens`` / ``active`` are the stream's ``N`` rows, ``slot`` / ``pos`` the decode rows' (the MLA step
    index is built from them), ``logits [Bk, V]`` the readout rows'."""

    bucket: int
    start: int
    tokens: torch.Tensor  # [N] int64: decode tokens, then the prompt
    active: torch.Tensor  # [N] bool
    slot: torch.Tensor  # [Bk] int32: decode rows' pool slots (0 = empty)
    pos: torch.Tensor  # [Bk] int64: decode rows' positions
    prefill_slot: torch.Tensor  # [1] int64: the prefilling sequence's slot
    prefill_pos: torch.Tensor  # [P] int64: start .. start + P - 1 (static per key)
    readout_rows: torch.Tensor  # [Bk] int64: the stream row each logits row is read from
    readout_active: torch.Tensor  # [Bk] bool
    logits: torch.Tensor  # [Bk, V] fp32
    mla_index: tuple[torch.Tensor, torch.Tensor] | None = None
    hidden: None = None  # a mixed step reads out logits (``StepIO.hidden``: DecodeExecutor refuses it otherwise)

    @property
    def prompt_tokens(self) -> int:
        return int(self.prefill_pos.shape[0])

    @classmethod
    def zeros(cls, bucket: int, prompt: int, start: int, vocab: int, device: torch.device) -> MixedIO:
        n = bucket + prompt
        return cls(bucket=bucket, start=start, tokens=torch.zeros(n, dtype=torch.long, device=device),
                   active=torch.zeros(n, dtype=torch.bool, device=device),
                   slot=torch.zeros(bucket, dtype=torch.int32, device=device),
                   pos=torch.zeros(bucket, dtype=torch.long, device=device),
                   prefill_slot=torch.zeros(1, dtype=torch.long, device=device),
                   prefill_pos=torch.arange(start, start + prompt, dtype=torch.long, device=device),
                   readout_rows=torch.arange(bucket, dtype=torch.long, device=device),
                   readout_active=torch.zeros(bucket, dtype=torch.bool, device=device),
                   logits=torch.zeros(bucket, vocab, dtype=torch.float32, device=device))

    def load(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, row: int,
             prompt: torch.Tensor) -> None:
        """Stage one mixed step without a host sync: ``tokens [B]`` (the token of ``row`` is ignored), the
        cache's ``slots`` / ``lengths``, the prefilling ``row`` and its ``prompt [P]``."""
        b, bk = int(tokens.shape[0]), self.bucket
        live = self.readout_active
        live.zero_()
        live[:b] = True
        live[row] = False  # the prefilling sequence has no decode row
        self.tokens[:b].copy_(tokens.reshape(b), non_blocking=True)
        self.tokens[b:bk].zero_()
        self.tokens[bk:].copy_(prompt.reshape(-1), non_blocking=True)
        self.active[:bk].copy_(live)
        self.active[bk:] = True
        self.slot.zero_()
        self.pos.zero_()
        torch.mul(slots, live[:b], out=self.slot[:b])
        torch.mul(lengths, live[:b], out=self.pos[:b])
        self.prefill_slot.copy_(slots[row:row + 1])
        self.readout_rows.copy_(torch.arange(bk, device=self.readout_rows.device))
        self.readout_rows[row] = bk + self.prompt_tokens - 1
        live[row] = True  # its logits row is the last prompt token's


def _kda_mixed(ops: OpCalls, a: KDAWeights, x: torch.Tensor, io: MixedIO, cache: Any, eps: float,
               residual: torch.Tensor | None, out: torch.Tensor) -> None:
    bk = io.bucket
    q, k, v, g = (ops("linear", x, w) for w in (a.q, a.k, a.v, a.g))
    decay = ops("linear", ops("linear", x, a.f_a), a.f_b)
    beta = ops("linear", x, a.b)
    if beta.shape[1] != a.heads:
        beta = beta[:, : a.heads].contiguous()
    pools = (cache.conv_q, cache.conv_k, cache.conv_v, cache.state)
    weights = (a.conv_q, a.conv_k, a.conv_v, a.A_log, a.dt_bias, a.o_norm)
    y_dec = ops("kda_step", *(t[:bk] for t in (q, k, v, g, decay, beta)), *weights, io.slot, *pools, eps=eps,
                lower_bound=a.lower_bound)
    y_pre = ops("kda_prefill", *(t[bk:] for t in (q, k, v, g, decay, beta)), *weights, io.prefill_slot, *pools,
                eps=eps, lower_bound=a.lower_bound)
    ops("linear", torch.cat([y_dec, y_pre]), a.o, residual=residual, out=out)


def _mla_mixed(ops: OpCalls, a: MLAWeights, x: torch.Tensor, io: MixedIO, cache: Any, eps: float,
               residual: torch.Tensor | None, out: torch.Tensor) -> None:
    bk, p = io.bucket, io.prompt_tokens
    q = ops("linear", ops("rmsnorm", ops("linear", x, a.q_a), a.q_a_norm, eps), a.q_b).view(-1, a.heads, a.q_head_dim)
    kv = ops("linear", x, a.kv_a)
    gate = ops("linear", x, a.g) if a.g is not None else None
    table, ctx_len = io.mla_index or mla_step_index(io.slot, io.pos, cache.latent.shape[1])
    o_dec = ops("mla_attention", q[:bk], kv[:bk], a.kv_norm, eps, cache.latent, cache.scale, io.slot, io.pos, table,
                ctx_len, a.w_uk, a.w_uv, a.softmax_scale, gate[:bk] if gate is not None else None)
    o_pre = ops("mla_prefill", q[bk:], kv[bk:], a.kv_norm, eps, cache.latent, cache.scale, io.prefill_slot,
                io.prefill_pos, a.w_uk, a.w_uv, a.softmax_scale, gate[bk:] if gate is not None else None,
                context=io.start + p)
    ops("linear", torch.cat([o_dec, o_pre]), a.o, residual=residual, out=out)


def run_mixed_step(plan: ModelPlan, ops: OpCalls, io: MixedIO, pool: Any, side: SideStream | None = None) -> None:
    """One mixed step (module docstring) on ``pool``: updates the decode rows' and the prefilling slot's
    caches, writes ``io.logits``. Capturable in a CUDA graph."""
    eps = plan.eps

    def attend(L: LayerPlan, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> None:
        (_kda_mixed if L.kind == "kda" else _mla_mixed)(ops, L.attn, x, io, pool.layers[L.idx], eps, residual, out)

    try:
        for sec in step_sections(plan, ops, io, pool, None, side, attend=attend,
                                 readout=(io.readout_rows, io.readout_active)):
            sec.run()
    finally:
        io.mla_index = None


@dataclass
class MixedCapture:
    io: MixedIO
    graph: Any = None
    standard_ops: list[dict[str, Any]] = field(default_factory=list)


class MixedStepRunner:
    """Mixed steps over one executor's plan and pool with ``table`` (the standard op table + prefill ops):
    ``step(key, tokens, slots, lengths, row, prompt)`` stages, then replays the key's graph (capturing it
    the first time, after an eager warm-up) or runs eagerly (a CPU, ``use_graphs=False``, a failed capture)."""

    def __init__(self, plan: ModelPlan, pool: Any, table: dict[str, OpImpl], vocab: int, device: torch.device,
                 use_graphs: bool, side: SideStream | None = None) -> None:
        self.plan, self.pool, self.table, self.vocab = plan, pool, table, vocab
        self.device = torch.device(device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.side = side
        self.captures: dict[MixedKey, MixedCapture] = {}
        self.eager_keys: dict[MixedKey, str] = {}  # key -> why its steps run eagerly
        self.graph_pool = None

    def _run(self, io: MixedIO) -> OpCalls:
        calls = OpCalls(self.table)
        run_mixed_step(self.plan, calls, io, self.pool, self.side)
        return calls

    @torch.no_grad()
    def step(self, key: MixedKey, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, row: int,
             prompt: torch.Tensor) -> tuple[MixedCapture, bool]:
        """Run one mixed step of ``key``; returns (its capture, whether a graph replay served it)."""
        cap = self.captures.get(key)
        if cap is None:
            bucket, p, start = key
            cap = self.captures[key] = MixedCapture(MixedIO.zeros(bucket, p, start, self.vocab, self.device))
        cap.io.load(tokens, slots, lengths, row, prompt)
        if cap.graph is not None:
            cap.graph.replay()
            return cap, True
        calls = self._run(cap.io)  # eager: a CPU, the warm-up before a capture, or an eager key
        cap.standard_ops = calls.standard_ops()
        if self.use_graphs and key not in self.eager_keys:
            self._capture(key, cap)
        return cap, False

    def _capture(self, key: MixedKey, cap: MixedCapture) -> None:
        """Capture the key's step into a graph. The eager step just before it was the warm-up (every kernel
        compiled, fla's autotuning done) and the step the caller asked for; a capture records without
        executing, so the caches hold that one step's writes."""
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self.graph_pool):
                self._run(cap.io)
            torch.cuda.synchronize(self.device)
        except RuntimeError as e:
            self.eager_keys[key] = f"capture failed: {str(e).splitlines()[0][:200]}"
            return
        cap.graph = g
