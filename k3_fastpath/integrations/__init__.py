"""Integrations of the fast path into serving stacks: ``vllm`` (a ``vllm.general_plugins`` entry point).

Importing this package imports nothing heavy; the vLLM model class lives in ``vllm_model`` and is
imported by vLLM itself, lazily, only when a Kimi K3 checkpoint is loaded."""
