"""Bringing a reference cache to a context length, shared by the checks that compare decode steps at a
context (``equivalence.decode``, ``equivalence.fp64``, ``perf.decode_sweep``): ``"short"`` = a prefill of the
prompt; N positions = synthetic state for ``[0, N - prompt_len)`` (MLA latents ~ N(0, 1) through the cache's
own encoding, KDA recurrent state ~ N(0, ``FILL_STATE_STD``^2), conv state ~ N(0, ``FILL_CONV_STD``^2): a
full-size prefill at 128K would up-project the whole latent cache) then ``prompt_len`` teacher-forced
reference decode steps."""

from __future__ import annotations

from typing import Any

import torch

FILL_STATE_STD = 0.05
FILL_CONV_STD = 0.5


def context_length(context: Any) -> int | None:
    """``"short"`` -> None (prompt only), an int or numeric string -> that many positions."""
    if context == "short":
        return None
    try:
        n = int(context)
    except (TypeError, ValueError):
        raise ValueError(f"context must be 'short' or a number of positions, got {context!r}") from None
    if n < 1:
        raise ValueError(f"context must be positive, got {n}")
    return n


@torch.no_grad()
def synthesize_context(cache: Any, positions: int, seed: int) -> None:
    """Fill positions ``[0, positions)`` of every sequence of a reference ``K3Cache`` with synthetic state
    (module docstring) and set its lengths; the same cache is then copied to the fast side. Drawn
    on the cache's device, one sequence's latents at a time (bounded memory at 128K positions)."""
    from k3_fastpath.reference.kda import KDACache

    dev = cache.lengths.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    for layer in cache.layers:
        if isinstance(layer, KDACache):
            st = layer.state
            st.copy_(torch.randn(st.shape, generator=gen, device=dev, dtype=st.dtype) * FILL_STATE_STD)
            for t in (layer.conv_q, layer.conv_k, layer.conv_v):
                t.copy_(torch.randn(t.shape, generator=gen, device=dev) * FILL_CONV_STD)
        else:
            b, _, d = layer.latent.shape
            for i in range(b):
                layer.latent[i, :positions] = layer.encode(torch.randn(positions, d, generator=gen, device=dev))
    cache.lengths = torch.full((cache.batch,), positions, dtype=torch.long, device=dev)


@torch.no_grad()
def fill_reference(model: Any, cache: Any, context: int | None, prompt_len: int, seed: int) -> torch.Tensor:
    """Bring a fresh reference cache to the point's context; returns the logits that pick the first token."""
    b = cache.batch
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.cfg.vocab_size, (b, prompt_len), generator=gen).to(model.device)
    if context is None:
        return model.prefill(prompt, None, cache)[:, -1]
    if context <= prompt_len:
        raise ValueError(f"context {context} must exceed prompt_len {prompt_len}")
    synthesize_context(cache, context - prompt_len, seed + 1)
    logits = None
    for t in range(prompt_len):
        logits = model.decode(prompt[:, t], cache)
    return logits
