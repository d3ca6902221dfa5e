"""lm-eval task definitions for k3-verify: GSM8K, AIME25 and MRCR (2/4/8 needles).

The YAMLs here are loaded by lm-eval through ``include_path`` (``TaskManager(include_path=evals/)`` or
``lm_eval --include_path evals/``); ``evals/utils.py`` holds the scorers and dataset loaders they name
with ``!function``; ``evals/thresholds.yaml`` holds the fast-path-vs-baseline gates; ``evals/data/`` makes
small synthetic datasets in the real formats and finds the real ones (local path or a pre-filled HF cache).
A python package so the YAMLs' ``!function utils.*`` and ``python -m evals.data.make_synthetic`` resolve.
"""
