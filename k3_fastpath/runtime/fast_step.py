"""One fast decode step of the whole model, written once for eager runs and CUDA-graph capture.

``step_plan.ModelPlan.build(model)`` gathers, per layer, the reference model's own weight tensors in the form
the kernels take (typed per layer kind); ``run_step(plan, ops, io, pool)`` then runs the step for a batch
bucket ``Bk``:

1. residual stream in one buffer ``src [S_max, Bk, H]``: block snapshots at 0..nb-1, the running prefix at
   nb, so ``src[:nb + 1]`` is exactly the ``[S, Bk, H]`` source stack ``attn_res`` takes, and closing a
   block is ``nb += 1`` (no copy). Embedding into ``src[0]`` (0 for inactive rows, as the reference).
2. per layer: ``attn_res`` (AttnRes mix + the sublayer's RMSNorm, one kernel) -> attention -> its output
   projection with the residual add fused (``linear(..., residual=prefix, out=prefix)``) -> ``attn_res``
   -> MLP / LatentMoE -> residual add. LatentMoE: the shared experts' GLU runs on a second CUDA stream
   (``SideStream``: event fork / join, captured into the graph) while the router, the latent down
   projection, ``moe_experts`` (+ the fused latent norm) and the latent up projection run on the main one;
   the shared down projection adds the routed output as its residual after the join;
3. ``attn_res`` with the final norm, ``lm_head`` with FP32 output into ``io.logits``; inactive rows 0. A
   step that reads out hidden states (``io.hidden`` given: the vLLM route, whose engine applies the final
   norm and lm_head itself) writes the final AttnRes mix before the norm there instead, and no logits.

KDA: q, k, v, g, f_a -> f_b, beta logits are separate ``linear`` calls (``kda_decode`` takes contiguous
[B, C] operands), then ``kda_step`` updates the slot pools in place (a verify step: from each sequence's
slot into the scratch slots of its rows, ``StepIO.kda_out``; ``verify_step.py``). MLA: q_a -> RMSNorm -> q_b, kv_a, the
gate projection, ``mla_attention`` (writes the latent at (slot, pos), absorbs q, ``mla_decode`` over the
pool with the block table / ctx_len = pos + 1 derived once per step, the gate fused), o_proj. Rows are independent
everywhere, so padded rows (slot 0, position 0) never touch a real sequence's cache or output.

Rounding differs from the reference by design in a few places: a fused residual add rounds once where
the reference rounds the projection and then the sum, and the logits come from an FP32 epilogue.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..reference.common import situ_glu
from .fast_ops import OpImpl, mla_step_index
from .step_plan import DenseMLPWeights, KDAWeights, LayerPlan, MLAWeights, ModelPlan, MoEWeights


# ------------------------------------------------------------------------------------------ step
@dataclass
class StepIO:
    """The static tensors a step reads and writes (views of the executor's buffers for one bucket)."""

    tokens: torch.Tensor  # [Bk] int64
    slot: torch.Tensor  # [Bk] int32: pool slot per row, 0 = empty (inactive / padded rows)
    pos: torch.Tensor  # [Bk] int64: the position each row's token takes (0 for empty rows)
    active: torch.Tensor  # [Bk] bool
    logits: torch.Tensor  # [Bk, V] fp32 (written; [Bk, 0] where ``hidden`` is the readout)
    # (block_table, ctx_len) of the MLA layers, derived from slot / pos by ``run_step`` for the step it runs
    # (None outside it; a caller that runs ``_mla`` without ``run_step`` gets them derived per layer)
    mla_index: tuple[torch.Tensor, torch.Tensor] | None = None
    # a verify step (``verify_step.py``): rows are ``tokens_per_seq`` consecutive tokens of each sequence;
    # KDA reads each sequence's state at ``kda_slot`` [Bk / T] and keeps the state after each row at
    # ``kda_out`` [Bk] (scratch slots, 0 for padded rows); None / 1: a decode step (KDA in place at ``slot``)
    kda_slot: torch.Tensor | None = None
    kda_out: torch.Tensor | None = None
    tokens_per_seq: int = 1
    # [Bk, H] model dtype: the hidden states the final norm reads (written instead of ``logits``); None: logits
    hidden: torch.Tensor | None = None

    @property
    def readout(self) -> torch.Tensor:
        """What the step writes per row: ``hidden`` where given, else ``logits``."""
        return self.logits if self.hidden is None else self.hidden

    def load(self, tokens: torch.Tensor, active: torch.Tensor | None, slots: torch.Tensor,
             lengths: torch.Tensor) -> None:
        """Stage one step of ``b`` rows into the bucket's buffers without a host sync: tokens, the active
        mask, each active row's slot and position (inactive rows get slot 0 / position 0, the empty slot);
        the padded rows ``b:`` are emptied."""
        b = int(tokens.shape[0])
        self.tokens[:b].copy_(tokens.reshape(b), non_blocking=True)
        if active is None:
            self.active[:b].fill_(True)
        else:
            self.active[:b].copy_(active.reshape(b), non_blocking=True)
        torch.mul(slots, self.active[:b], out=self.slot[:b])
        torch.mul(lengths, self.active[:b], out=self.pos[:b])
        for t in (self.tokens, self.slot, self.pos, self.active):
            t[b:].zero_()

    @classmethod
    def zeros(cls, bucket: int, vocab: int, device: torch.device,
              hidden: tuple[int, torch.dtype] | None = None) -> StepIO:
        """The static buffers of one batch bucket (every row empty: slot 0, position 0, inactive); ``hidden``
        ``(H, dtype)``: a step that reads out hidden states instead of logits."""
        return cls(tokens=torch.zeros(bucket, dtype=torch.long, device=device),
                   slot=torch.zeros(bucket, dtype=torch.int32, device=device),
                   pos=torch.zeros(bucket, dtype=torch.long, device=device),
                   active=torch.zeros(bucket, dtype=torch.bool, device=device),
                   logits=torch.zeros(bucket, 0 if hidden else vocab, dtype=torch.float32, device=device),
                   hidden=None if hidden is None else torch.zeros(bucket, hidden[0], dtype=hidden[1], device=device))


class OpCalls:
    """The op table as a step calls it: counts calls per op (host side, so a capture counts once)."""

    def __init__(self, table: dict[str, OpImpl]) -> None:
        self.table = table
        self.calls: Counter[str] = Counter()

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.calls[name] += 1
        return self.table[name](*args, **kwargs)

    def standard_ops(self) -> list[dict[str, Any]]:
        return [{"op": n, "reason": self.table[n].standard_reason, "calls": c}
                for n, c in sorted(self.calls.items()) if self.table[n].standard_reason]


def _kda(ops: OpCalls, a: KDAWeights, x: torch.Tensor, io: StepIO, cache: Any, eps: float,
         residual: torch.Tensor | None, out: torch.Tensor) -> None:
    q, k, v, g = (ops("linear", x, w) for w in (a.q, a.k, a.v, a.g))
    decay = ops("linear", ops("linear", x, a.f_a), a.f_b)
    beta = ops("linear", x, a.b)
    if beta.shape[1] != a.heads:  # zero-padded rows of the beta projection (glue: a [Bk, heads] copy)
        beta = beta[:, : a.heads].contiguous()
    verify = {} if io.kda_out is None else {"slot_out": io.kda_out, "tokens": io.tokens_per_seq}
    slot = io.slot if io.kda_slot is None else io.kda_slot
    if getattr(cache, "vllm_layout", False):  # vLLM's packed conv window and [V, K] state in place, its indices
        pools, verify, slot = (cache.conv, None, None, cache.state), {"vllm_layout": True}, cache.slot
    else:
        pools = (cache.conv_q, cache.conv_k, cache.conv_v, cache.state)
    y = ops("kda_step", q, k, v, g, decay, beta, a.conv_q, a.conv_k, a.conv_v, a.A_log, a.dt_bias,
            a.o_norm, slot, *pools, eps=eps, lower_bound=a.lower_bound, **verify)
    ops("linear", y, a.o, residual=residual, out=out)


def _mla(ops: OpCalls, a: MLAWeights, x: torch.Tensor, io: StepIO, cache: Any, eps: float,
         residual: torch.Tensor | None, out: torch.Tensor) -> None:
    bk = x.shape[0]
    q = ops("linear", ops("rmsnorm", ops("linear", x, a.q_a), a.q_a_norm, eps), a.q_b)
    kv = ops("linear", x, a.kv_a)
    gate = ops("linear", x, a.g) if a.g is not None else None  # the output gate: fused into mla_decode
    if getattr(cache, "paged", None) is not None:  # vLLM's paged cache in place: its table, the new latent's page
        (table, ctx_len, wslot, wpos), paged = cache.paged, {"paged": True}
    else:
        table, ctx_len = io.mla_index or mla_step_index(io.slot, io.pos, cache.latent.shape[1])
        wslot, wpos, paged = io.slot, io.pos, {}
    o = ops("mla_attention", q.view(bk, a.heads, a.q_head_dim), kv, a.kv_norm, eps, cache.latent,
            cache.scale, wslot, wpos, table, ctx_len, a.w_uk, a.w_uv, a.softmax_scale, gate, **paged)
    ops("linear", o, a.o, residual=residual, out=out)


class SideStream:
    """A second CUDA stream for work that overlaps the main path inside one step (the shared experts next
    to the routed experts): ``fork()`` makes it wait for the main stream's work so far, ``join()`` makes the
    main stream wait for it. Both are stream-ordered events (no host synchronisation), captured into the
    step's graph as a fork / join. On a CPU (or disabled) it is a no-op and the work runs in order."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if enabled and self.device.type == "cuda" else None

    def fork(self) -> Any:
        """Context manager: the work inside runs on the side stream, after everything issued so far."""
        import contextlib

        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def join(self, *tensors: torch.Tensor) -> None:
        """The main stream waits for the side stream; ``tensors`` made there are now used on the main stream
        (recorded, so the caching allocator does not hand their memory to the side stream too early)."""
        if self.stream is None:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_stream(self.stream)
        for t in tensors:
            t.record_stream(main)


def mlp_activation(ops: OpCalls, g: torch.Tensor, u: torch.Tensor, cfg: Any) -> torch.Tensor:
    """SiTU-GLU of the gate / up projections, rounded to their dtype: the ``situ_glu`` op (one kernel) where
    the table has it (``op_table(DecodeOptions(situ_glu_kernel=True))``), else the PyTorch glue."""
    beta, lb = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    if "situ_glu" in ops.table:
        return ops("situ_glu", g, u, beta, lb)
    return situ_glu(g, u, beta, lb).to(g.dtype)


def _shared_experts(ops: OpCalls, m: MoEWeights, x: torch.Tensor, cfg: Any) -> torch.Tensor:
    return mlp_activation(ops, ops("linear", x, m.shared_gate), ops("linear", x, m.shared_up), cfg)


def _mlp(ops: OpCalls, m: MoEWeights | DenseMLPWeights, x: torch.Tensor, eps: float, prefix: torch.Tensor, cfg: Any,
         side: SideStream | None = None) -> None:
    if isinstance(m, DenseMLPWeights):  # the dense MLP of the first layers
        h = mlp_activation(ops, ops("linear", x, m.gate), ops("linear", x, m.up), cfg)
        ops("linear", h, m.down, residual=prefix, out=prefix)
        return
    side = side or SideStream(x.device, enabled=False)
    with side.fork():  # the shared experts' GLU on the side stream, overlapping router + routed experts
        h = _shared_experts(ops, m, x, cfg)
    ids, weights = ops("moe_router", x, m.router, m.bias, m.top_k, m.renormalize, m.scale)
    z = ops("linear", x, m.latent_down)
    if m.latent_norm is not None:  # the routed latent RMSNorm fused into the experts' combine
        zr = ops("moe_experts", z, ids, weights, m.bank, m.latent_norm, eps)
    else:
        zr = ops("moe_experts", z, ids, weights, m.bank).to(x.dtype)
    routed = ops("linear", zr, m.latent_up)
    side.join(h)
    f = ops("linear", h, m.shared_down, residual=routed)  # shared + routed, rounded once
    prefix.add_(f)


def _mix(ops: OpCalls, src: torch.Tensor, nb: int, norm_w: torch.Tensor, proj_w: torch.Tensor,
         out_w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm(AttnRes mix of src[:nb+1]) * out_w (``out_w`` None: the mix); with no block yet the mix is the
    prefix itself."""
    if nb == 0:
        return src[0] if out_w is None else ops("rmsnorm", src[0], out_w, eps)
    return ops("attn_res", src[: nb + 1], norm_w, proj_w, eps, out_w)


def run_step(plan: ModelPlan, ops: OpCalls, io: StepIO, pool: Any, prefetcher: Any = None,
             side: SideStream | None = None) -> None:
    """One decode step for the bucket of ``io``: reads io.tokens/slot/pos/active and the caches of ``pool``,
    updates the caches of the non-empty slots, writes ``io.logits``. Capturable in a CUDA graph. ``side``:
    the stream the shared experts overlap the routed experts on (None: in order on the current stream)."""
    try:
        for sec in step_sections(plan, ops, io, pool, prefetcher, side):
            sec.run()
    finally:
        io.mla_index = None


@dataclass
class Section:
    """One contiguous piece of a step: ``name`` (e.g. ``L3.attn``), its layer type (``head`` / ``kda`` /
    ``mla`` / ``moe`` / ``dense_mlp``, floor.py's ``LAYER_TYPES``) and the work. Running a step's sections
    in order IS the step; ``section_timing`` captures each into its own graph to time layer types."""

    name: str
    layer_type: str
    run: Any


def step_sections(plan: ModelPlan, ops: OpCalls, io: StepIO, pool: Any, prefetcher: Any = None,
                  side: SideStream | None = None, src: torch.Tensor | None = None, attend: Any = None,
                  readout: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[Section]:
    """The step of ``run_step`` as ordered sections: ``head.in`` (MLA step index, embedding), per layer
    ``L{n}.attn`` (AttnRes mix + norm, attention, o_proj + residual) and ``L{n}.mlp`` (mix + norm, MLP or
    LatentMoE + residual), ``head.out`` (final mix + norm, lm_head, inactive rows zeroed). The residual
    stream ``src`` (``[S_max, rows, H]``) is allocated by the first section unless given (a caller that runs
    the sections as separate graphs passes a static one). Block bookkeeping is host-side and static.
    ``attend(layer_plan, x, residual, out)``: the attention of a layer (default: one decode token per row,
    ``_kda`` / ``_mla``); ``readout``: ``(rows, active)``, the stream rows whose logits fill ``io.logits``
    and which of them are live (default: every row, ``io.active``). The mixed step (``mixed_step.py``) sets
    both."""
    bk = io.tokens.shape[0]
    embed = plan.embed
    eps = plan.eps
    layers = plan.layers
    state: dict[str, Any] = {"src": src}

    def decode_attend(L: LayerPlan, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> None:
        (_kda if L.kind == "kda" else _mla)(ops, L.attn, x, io, pool.layers[L.idx], eps, residual, out)

    attend = attend or decode_attend

    def head_in() -> None:
        mla = [c for c in pool.layers if hasattr(c, "latent") and getattr(c, "paged", None) is None]
        io.mla_index = mla_step_index(io.slot, io.pos, mla[0].latent.shape[1]) if mla else None
        if state["src"] is None:
            state["src"] = torch.empty(plan.num_sources, bk, embed.shape[1], dtype=embed.dtype, device=embed.device)
        s = state["src"]
        torch.index_select(embed, 0, io.tokens, out=s[0])
        s[0].mul_(io.active.to(embed.dtype)[:, None])  # inactive rows carry a zero stream, as in the reference

    def attn(n: int, L: LayerPlan, nb: int) -> None:
        s = state["src"]
        x = _mix(ops, s, nb - 1 if L.closes_block else nb, L.attn_res_norm, L.attn_res_proj, L.input_norm, eps)
        residual = None if L.closes_block else s[nb]  # closing a block: the prefix restarts at the output
        if prefetcher is not None and n + 1 < len(layers):
            prefetcher.issue(layers[n + 1].weights())  # next layer's weights into L2 while this one attends
        attend(L, x, residual, s[nb])

    def mlp(L: LayerPlan, nb: int) -> None:
        s = state["src"]
        x = _mix(ops, s, nb, L.mlp_res_norm, L.mlp_res_proj, L.post_norm, eps)
        _mlp(ops, L.mlp, x, eps, s[nb], plan.cfg, side)

    def head_out(nb: int) -> None:
        s = state["src"][: nb + 1]
        if readout is not None:  # only the rows that give logits pass the final mix and lm_head
            s = s.index_select(1, readout[0])
        live = io.active if readout is None else readout[1]
        if io.hidden is not None:  # the hidden states the final norm reads; the engine applies norm and lm_head
            io.hidden.copy_(_mix(ops, s, nb, plan.out_res_norm, plan.out_res_proj, None, eps))
            io.hidden.masked_fill_(~live[:, None], 0.0)
        else:
            x = _mix(ops, s, nb, plan.out_res_norm, plan.out_res_proj, plan.final_norm, eps)
            ops("linear", x, plan.lm_head, out=io.logits, out_dtype=torch.float32)
            io.logits.masked_fill_(~live[:, None], 0.0)
        if prefetcher is not None:
            prefetcher.join()

    out = [Section("head.in", "head", head_in)]
    nb = 0
    for n, L in enumerate(layers):
        if L.closes_block:
            nb += 1  # the incoming stream becomes block nb-1
        out.append(Section(f"L{n}.attn", L.kind, lambda n=n, L=L, nb=nb: attn(n, L, nb)))
        out.append(Section(f"L{n}.mlp", "moe" if L.moe else "dense_mlp", lambda L=L, nb=nb: mlp(L, nb)))
    out.append(Section("head.out", "head", lambda nb=nb: head_out(nb)))
    return out
