"""Evals through lm-eval, fast path vs baseline in the same run.

- ``runner``: run tasks from ``evals/`` on one engine via lm-eval's evaluator and turn its sample
  log into per-sample records (hashes, responses, scores, output tokens, truncation, extraction failures);
- ``lm_adapter`` / ``api_lm``: the lm-eval models (any ``Engine``; lm-eval's own API models for servers);
- ``stats``: exact McNemar, paired bootstrap, per-item means over repeats;
- ``gates``: thresholds from ``evals/thresholds.yaml`` -> metrics and failure reasons;
- ``rescore``: the ``bundle verify`` rescorer that re-derives all of it from the records;
- ``batching``: how many chats go to one engine call (the adapter and the likelihood check);
- ``likelihood``: the gold answers' likelihood gate and its rescorer (``likelihood.gold_answers``);
  ``rejudge``: recorded likelihoods judged under other margins.

Only ``rescore``, ``likelihood``, ``gates`` and ``stats`` are imported by ``bundle verify`` (no lm-eval, no
torch there).
"""
