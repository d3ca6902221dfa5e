"""A training or held-out item as token ids and a loss mask, and rows of them as padded tensors."""

from __future__ import annotations

import torch

from ..tokenizer import EOS_ID, PAD_ID
from . import tasks


def item_row(tok, item: tasks.TaskItem) -> tuple[list[int], list[int]]:
    """An item as one sequence of token ids and its loss mask, its prompt rendered as the eval runner sends
    it: a task of ``tasks.CHAT_TASKS`` as the chat through the template with the generation prompt (what
    ``Engine.chat`` tokenizes), any other as the prompt text, the answer after a space (a completion);
    then the answer's tokens and ``<|im_end|>``, the mask 1 on the answer only."""
    answer = item.messages[-1]["content"]
    if item.task in tasks.CHAT_TASKS:
        prompt = tok.apply_chat_template(list(item.messages[:-1]), tokenize=False, add_generation_prompt=True)
    else:
        prompt, answer = item.messages[-2]["content"], " " + answer
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tok(answer, add_special_tokens=False)["input_ids"] + [EOS_ID]
    return p_ids + a_ids, [0] * len(p_ids) + [1] * len(a_ids)


def padded(rows: list[tuple[list[int], list[int]]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of (ids, mask) as right-padded ``ids [B, T]``, ``lengths [B]`` and ``mask [B, T]`` (int8: each
    token's mask value, 0 off the answers; training marks answer tokens with their task's number,
    ``batches.Batches``, so ``mask != 0`` is the loss mask)."""
    t = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), t), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.int8)
    for i, (r, m) in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.int8)
    lengths = torch.tensor([len(r) for r, _ in rows])
    return ids.to(device), lengths.to(device), mask.to(device)
