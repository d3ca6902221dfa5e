"""Speculative decoding's acceptance: which draft tokens a verify step keeps, and the token it adds.

A verify step of one request scores ``1 + k`` positions at once: the target's logits ``[k + 1, V]``, row
``i`` conditioned on the context and draft tokens ``0..i-1``. ``verify_draft`` decides how many of the
``k`` draft tokens are accepted (``a``) and emits ``a + 1`` tokens: the accepted drafts and one more, a
correction at the first rejected position or, when all ``k`` are accepted, a bonus token from row ``k``.

- **Greedy** (``temperature == 0``): draft token ``i`` is accepted iff it is the argmax of row ``i``
  (after row ``i``'s grammar bitmask); the added token is that row's argmax. The emitted tokens are
  exactly plain greedy decoding's.
- **Sampling** (``temperature > 0``, with top-k / top-p): the standard speculative-sampling rule (Leviathan
  et al. 2023; Chen et al. 2023). With ``p_i`` the target's sampling distribution at row ``i``
  (``sampler.filtered_logits``, after the bitmask) and ``q_i`` the drafter's distribution the draft token
  ``x_i`` was drawn from (one-hot for a deterministic drafter: ``draft_probs`` None), ``x_i`` is accepted
  with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection the added token is drawn from
  ``normalise(max(0, p_i - q_i))``; after ``k`` acceptances from ``p_k``. The emitted tokens then follow
  the target's own distribution exactly, whatever the drafter proposes (``tests/test_spec_sampler.py``
  holds the first two emitted tokens to the exact joint distribution).

Random draws come from the request's own generator in a fixed order: one uniform per examined draft
position, then one categorical draw for the added token, so a request's tokens do not depend on the batch.
Grammar: ``bitmasks[i]`` is the grammar's mask after the context and draft tokens ``0..i-1`` (the matcher
advanced along the draft and rolled back past the rejection by the caller), so a speculated token outside
the grammar is rejected like any other and the added token obeys the grammar too.

``AcceptanceStats`` counts, per draft position, how often it was examined and accepted: the per-position
acceptance rates and the mean acceptance length (``1 +`` accepted tokens per verify step) a gate compares.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampler import SamplingConfig, apply_bitmask, filtered_logits


@dataclass(frozen=True)
class Verdict:
    """One verify step of one request: ``accepted`` draft tokens kept, ``tokens`` the ``accepted + 1`` emitted."""

    accepted: int
    tokens: tuple[int, ...]


def _rows(target_logits: torch.Tensor, bitmasks: torch.Tensor | None) -> torch.Tensor:
    x = target_logits.float()
    if bitmasks is not None:
        x = apply_bitmask(x, bitmasks)
    if not bool(torch.isfinite(x).any(-1).all()):
        raise ValueError("no token is allowed at some verify position: the grammar bitmask excludes every token")
    return x


def verify_draft(target_logits: torch.Tensor, draft_tokens: torch.Tensor, cfg: SamplingConfig,
                 generator: torch.Generator | None = None, draft_probs: torch.Tensor | None = None,
                 bitmasks: torch.Tensor | None = None) -> Verdict:
    """Accept a prefix of ``draft_tokens [k]`` against ``target_logits [k + 1, V]`` (module docstring);
    ``draft_probs [k, V]``: the drafter's distributions (None: a deterministic drafter, one-hot);
    ``bitmasks [k + 1, words]``: the grammar's mask per row (None: unconstrained)."""
    k = int(draft_tokens.shape[0])
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(f"{k} draft tokens need {k + 1} rows of target logits, got {list(target_logits.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_logits.shape[1]):
        raise ValueError(f"draft_probs must be [{k}, {target_logits.shape[1]}], got {list(draft_probs.shape)}")
    x = _rows(target_logits, bitmasks)
    draft = [int(t) for t in draft_tokens.tolist()]
    if cfg.greedy:
        best = x.argmax(-1).tolist()
        a = 0
        while a < k and draft[a] == best[a]:
            a += 1
        return Verdict(a, tuple(draft[:a]) + (int(best[a]),))
    if generator is None:
        raise ValueError("sampling (temperature > 0) needs the request's torch.Generator")
    p = torch.stack([torch.softmax(filtered_logits(row, cfg), dim=-1) for row in x]).to(generator.device)
    q = None if draft_probs is None else draft_probs.float().to(generator.device)
    for i, t in enumerate(draft):
        qi = 1.0 if q is None else float(q[i, t])
        if qi <= 0.0:
            raise ValueError(f"draft token {t} at position {i} has probability 0 under draft_probs: the drafter "
                             "did not draw it from the distribution it reports")
        u = float(torch.rand((), generator=generator, device=generator.device))
        if u < min(1.0, float(p[i, t]) / qi):
            continue
        residual = p[i].clone()
        if q is None:
            residual[t] = 0.0
        else:
            residual = (residual - q[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p_i <= q_i everywhere: p_i == q_i, which accepts surely
            residual = p[i]
        return Verdict(i, tuple(draft[:i]) + (int(torch.multinomial(residual, 1, generator=generator)),))
    return Verdict(k, tuple(draft) + (int(torch.multinomial(p[k], 1, generator=generator)),))


@dataclass
class AcceptanceStats:
    """Per draft position: verify steps that examined it and that accepted it (position ``i`` is examined
    when drafts ``0..i-1`` were accepted)."""

    examined: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    steps: int = 0

    def add(self, drafted: int, verdict: Verdict) -> None:
        """One verify step that proposed ``drafted`` tokens and ended in ``verdict``."""
        if not 0 <= verdict.accepted <= drafted:
            raise ValueError(f"{verdict.accepted} accepted of {drafted} drafted")
        grow = drafted - len(self.examined)
        if grow > 0:
            self.examined += [0] * grow
            self.accepted += [0] * grow
        for i in range(min(verdict.accepted + 1, drafted)):
            self.examined[i] += 1
        for i in range(verdict.accepted):
            self.accepted[i] += 1
        self.steps += 1

    def rates(self) -> list[float | None]:
        """Per position: accepted / examined (None where never examined)."""
        return [a / e if e else None for a, e in zip(self.accepted, self.examined, strict=True)]

    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify step: 1 + the mean number accepted (None before any step)."""
        return None if not self.steps else 1.0 + sum(self.accepted) / self.steps

    def record(self) -> dict:
        return {"steps": self.steps, "examined": list(self.examined), "accepted": list(self.accepted),
                "rates": self.rates(), "mean_acceptance_length": self.mean_acceptance_length()}
