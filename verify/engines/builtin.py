"""``builtin``: k3_fastpath's own generator serving a model in this process.

``BuiltinEngine(preset, path="reference" | "fast", device, seed, max_model_len)``:

- the model: a preset with seeded synthetic weights (``k3_fastpath.synthetic``, weight seed ``seed``,
  ``conditioning="stable"`` unless told otherwise: on the default draw BF16 rounding is amplified until two
  correct implementations part beyond each other's top-5 within a few greedy tokens, so a fast-vs-reference
  comparison of generations would measure the draw, not the engine), or
  a checkpoint directory (``k3_fastpath.weights.load_checkpoint``), in FP32 on a CPU and BF16 on CUDA
  unless ``dtype`` says otherwise; inside ``k3-verify run`` the runner hands over the run's
  ``model_source`` and a checkpoint's tensors come from it (read once, the digest the bundle records);
- speculative decoding (``path`` with ``+spec=ngram:K``, ``k3_fastpath.runtime.spec_decode``): every
  request of more than one token runs verify steps of up to ``K`` drafts on the stepper; each
  completion's ``extra["acceptance"]`` holds its per-position acceptance counts;
- the stepper: ``path="reference"`` runs the PyTorch reference (``K3ForCausalLM``, the standard path; on
  a GPU with room its MXFP4 experts are kept dequantised, ``describe()["dense_experts_bytes"]``: bitwise
  the same results without dequantising every expert at every step);
  ``path="fast"`` runs the fast-path ``DecodeExecutor`` (``k3_fastpath/runtime/executor.py``), which needs
  the CuTe DSL and an sm_90 GPU: anywhere else it raises ``EngineError`` saying what is missing;
- the text side: a checkpoint's own tokenizer, or for a synthetic model the tiny trained tokenizer
  (``k3_fastpath.tokenizer``, exactly the model's vocabulary, eos ``<|im_end|>`` = id 2 for k3-tiny);
- sampling (``k3_fastpath.runtime.sampler``): a request without a seed gets one from the engine's
  own stream (seeded by ``seed``), so a whole run is reproducible, like a server started with ``--seed``;
- structured output: xgrammar bitmasks (``grammar.py``);
- the context limit: ``len(prompt) + max_tokens > max_model_len`` raises ``ContextLimitError``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from verify.engines.base import (
    Completion,
    Constraint,
    ContextLimitError,
    EngineError,
    SamplingParams,
    ScoredContinuation,
)


def fast_path_unavailable_reason(device: str) -> str | None:
    """Why ``builtin:fast`` cannot run on ``device`` here, or None."""
    from k3_fastpath._lib import arch

    if not str(device).startswith("cuda"):
        return f"the fast path runs on an sm_90 CUDA device (H100/H200), not on {device!r}"
    return arch.sm90_unsupported_reason(torch.device(device))


def _load_weights(preset: str, seed: int, model_source: Any = None, conditioning: str = "stable"
                  ) -> tuple[Any, dict[str, torch.Tensor], str, Path | None]:
    from k3_fastpath.presets import get_config, is_preset_spec

    if model_source is not None and model_source.is_checkpoint and model_source.preset == preset:
        return (model_source.config, model_source.state_dict(), f"checkpoint {model_source.path} "
                f"(digest {model_source.digest})", Path(model_source.path))
    if is_preset_spec(preset):  # a preset or a preset spec with overrides (e.g. k3-tiny:experts=8)
        from k3_fastpath.synthetic import synthetic_state_dict

        cfg = get_config(preset)
        return (cfg, synthetic_state_dict(cfg, seed, conditioning=conditioning),
                f"synthetic (seed {seed}, conditioning {conditioning})", None)
    root = Path(preset)
    if not root.is_dir():
        raise EngineError(f"builtin engine: {preset!r} is neither a preset nor a checkpoint directory")
    from k3_fastpath.weights import load_checkpoint

    cfg, sd = load_checkpoint(root)
    return cfg, sd, f"checkpoint {root}", root


def _load_tokenizer(cfg: Any, checkpoint: Path | None, tokenizer_seed: int) -> tuple[Any, str]:
    if checkpoint is not None and any((checkpoint / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(checkpoint)), f"{checkpoint} (its own)"
    from k3_fastpath.tokenizer import MAX_VOCAB, build_tiny_tokenizer

    if cfg.vocab_size > MAX_VOCAB:
        raise EngineError(f"no tokenizer for {cfg.name}: its vocabulary ({cfg.vocab_size}) is larger than the "
                          f"tiny trained tokenizer's maximum ({MAX_VOCAB}); use a checkpoint with its tokenizer "
                          "or token-id prompts")
    return build_tiny_tokenizer(cfg.vocab_size, seed=tokenizer_seed), f"tiny BPE (vocab {cfg.vocab_size}, seed {tokenizer_seed})"


def _fast_stepper(model: Any, device: str, max_model_len: int, max_batch: int, defect: str | None = None,
                  spec_tokens: int = 0) -> tuple[Any, Any]:
    """The fast-path ``DecodeExecutor`` over ``model``, every kernel compiled and every bucket's CUDA graph
    captured before the first request (a compile inside a request would be timed and could not be graphed),
    and the ``verify.defects.PlantedDefect`` planted into it before the capture (None without ``defect``).
    ``spec_tokens``: 1 + the drafts of speculative decoding (its fused verify steps' scratch; 0: none)."""
    reason = fast_path_unavailable_reason(device)
    if reason:
        raise EngineError(f"builtin:fast is unavailable here: {reason}; use builtin:reference")
    try:
        from k3_fastpath.runtime.executor import DecodeExecutor
    except ImportError as e:
        raise EngineError(f"builtin:fast: the fast-path executor cannot be imported ({e})") from e
    try:
        ex = DecodeExecutor(model, max_len=max_model_len, max_batch=max_batch, spec_tokens=spec_tokens)
        if ex.model_reason:
            raise EngineError(f"builtin:fast: the model is outside the fast path's envelope: {ex.model_reason}")
        planted = None
        if defect:
            from verify.defects import PlantedDefect

            planted = PlantedDefect(ex, defect)
        ex.warmup_and_capture()
    except EngineError:
        raise
    except Exception as e:
        raise EngineError(f"builtin:fast: DecodeExecutor could not be built: {type(e).__name__}: {e}") from e
    return ex, planted


class BuiltinEngine:
    """The ``Engine`` protocol over ``k3_fastpath.runtime.generator.Generator``."""

    def __init__(self, preset: str = "k3-tiny", path: str = "reference", device: str = "cpu", seed: int = 0,
                 max_model_len: int | None = None, dtype: torch.dtype | str | None = None,
                 tokenizer_seed: int = 0, max_batch: int = 256, model_source: Any = None,
                 conditioning: str = "stable") -> None:
        from k3_fastpath.reference.model import load_reference
        from k3_fastpath.runtime.generator import Generator
        from verify.engines import split_builtin

        spec_path = path
        path, opts = split_builtin(spec_path)  # "fast+defect=NAME" (verify/defects.py), "+spec=ngram:3"
        defect = opts.get("defect")
        self.name = f"builtin:{spec_path}"
        self.path = path
        self.defect: Any = None  # the PlantedDefect of a fast path built with one
        self.device = str(device)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineError(f"{self.name}: device {self.device!r} was asked for but torch sees no CUDA device")
        if path == "fast":  # fail before loading anything
            reason = fast_path_unavailable_reason(self.device)
            if reason:
                raise EngineError(f"builtin:fast is unavailable here: {reason}; use builtin:reference")
        self.seed = int(seed)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.dtype = dtype or (torch.bfloat16 if self.device.startswith("cuda") else torch.float32)
        cfg, sd, self.weights_source, checkpoint = _load_weights(preset, self.seed, model_source, conditioning)
        self.cfg = cfg
        self.preset = preset
        limit = cfg.max_position_embeddings
        self._max_model_len = int(max_model_len or limit)
        if not (2 <= self._max_model_len <= limit):
            raise EngineError(f"{self.name}: max_model_len {self._max_model_len} must lie in 2..{limit} "
                              f"({cfg.name}'s max_position_embeddings)")
        self.model = load_reference(cfg, sd, dtype=self.dtype, device=self.device).eval()
        del sd
        self.dense_experts_bytes = 0  # the reference path keeps its MXFP4 experts dequantised where they fit
        if path == "reference":
            from k3_fastpath.reference.moe import keep_dense_experts_if_room

            # a tenth of the free memory at most: the engine stays alive beside later checks' models
            self.dense_experts_bytes = keep_dense_experts_if_room(self.model, share=0.1)
        self.speculation: Any = None
        if "spec" in opts:
            from k3_fastpath.runtime.spec_decode import SpecConfig, Speculation

            try:
                self.speculation = Speculation.from_config(SpecConfig.parse(opts["spec"]), self.model, self.seed)
            except ValueError as e:
                raise EngineError(f"{self.name}: {e}") from None
        if path == "fast":  # decode batches stay within the executor's slot pool (its largest bucket)
            max_batch = min(max_batch, 64)
            stepper, self.defect = _fast_stepper(self.model, self.device, self._max_model_len, max_batch, defect,
                                                 spec_tokens=self.speculation.k + 1 if self.speculation else 0)
        else:
            stepper = self.model
        self.generator = Generator(stepper, cfg.vocab_size, self._max_model_len, device=self.device,
                                   max_batch=max_batch, spec=self.speculation)
        self.tokenizer_seed = tokenizer_seed
        self._tokenizer: Any = None
        self._tokenizer_desc: str | None = None
        self._no_tokenizer: str | None = None
        try:
            self._tokenizer, self._tokenizer_desc = _load_tokenizer(cfg, checkpoint, tokenizer_seed)
        except EngineError as e:  # token-id prompts still work; text features say why they cannot
            self._no_tokenizer = str(e)
        eos = {int(cfg.eos_token_id)}
        if self._tokenizer is not None and self._tokenizer.eos_token_id is not None:
            eos.add(int(self._tokenizer.eos_token_id))
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self._grammar: Any = None
        self._closed_description: dict[str, Any] | None = None
        self._seed_stream = random.Random(self.seed)
        self.closed = False

    # ------------------------------------------------------------------ properties
    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise EngineError(f"{self.name}: {self._no_tokenizer}")
        return self._tokenizer

    # ------------------------------------------------------------------ text
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        return [int(t) for t in prompt]

    def _grammar_compiler(self) -> Any:
        if self._grammar is None:
            from verify.engines.grammar import GrammarCompiler

            self._grammar = GrammarCompiler(self.tokenizer, self.vocab_size, list(self.eos_token_ids))
        return self._grammar

    # ------------------------------------------------------------------ serving
    def _check_open(self) -> None:
        if self.closed:
            raise EngineError(f"{self.name}: the engine was closed")

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams,
                 constraint: Constraint | None = None, seeds: list[int] | None = None) -> list[Completion]:
        """The prompts completed as one batch. ``seeds``: one per prompt, each request's own sampling seed in
        place of ``params.seed`` (each row samples from its own generator: a request draws the same random
        numbers in any batch), so sampled requests with different seeds share the batch's decode steps."""
        from k3_fastpath.runtime.generator import GenerationRequest
        from k3_fastpath.runtime.sampler import SamplingConfig

        self._check_open()
        if isinstance(prompts, str):
            raise EngineError("generate takes a list of prompts (wrap a single prompt in a list)")
        try:
            sampling = SamplingConfig(params.temperature, params.top_k, params.top_p)
        except ValueError as e:
            raise EngineError(f"{self.name}: {e}") from None
        if params.stop or constraint is not None:
            self.tokenizer  # noqa: B018 - text features need the tokenizer: fail before any compute
        if seeds is not None and len(seeds) != len(prompts):
            raise EngineError(f"{self.name}: {len(seeds)} seeds for {len(prompts)} prompts")
        ids = [self._prompt_ids(p) for p in prompts]
        reqs = []
        for i, p in enumerate(ids):
            seed = (seeds[i] if seeds is not None else params.seed if params.seed is not None
                    else self._seed_stream.getrandbits(63))
            reqs.append(GenerationRequest(
                prompt_ids=p, max_tokens=params.max_tokens, sampling=sampling, seed=seed, logprobs=params.logprobs,
                stop_token_ids=self.eos_token_ids, ignore_stop_tokens=params.ignore_eos,
                constraint=None if constraint is None else self._grammar_compiler().matcher(constraint),
                stop_when=self._stop_when(params.stop) if params.stop else None))
        return [self._completion(r, o, params) for r, o in zip(reqs, self._serve(reqs), strict=True)]

    def _serve(self, reqs: list[Any]) -> list[Any]:
        """The generator's outputs for ``reqs``; its refusals as the engine's errors."""
        from k3_fastpath.runtime.generator import ContextLengthError

        try:
            return self.generator.generate(reqs)
        except ContextLengthError as e:
            raise ContextLimitError(f"{self.name}: {e}") from None
        except ValueError as e:
            raise EngineError(f"{self.name}: {e}") from None

    def _stop_when(self, stops: tuple[str, ...]):
        def stop_when(tokens: list[int]) -> bool:
            text = self.detokenize(tokens)
            return any(s in text for s in stops)
        return stop_when

    def _completion(self, req: Any, out: Any, params: SamplingParams) -> Completion:
        text = self.detokenize(out.token_ids) if self._tokenizer is not None else ""
        if params.stop:
            cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
        extra: dict[str, Any] = {"seed": req.seed}
        if out.stop_token is not None:
            extra["stop_token"] = out.stop_token
        if req.constraint is not None:
            extra["grammar_terminated"] = req.constraint.is_terminated()
        if out.acceptance is not None:
            extra["acceptance"] = out.acceptance
        return Completion(text=text, token_ids=list(out.token_ids), finish_reason=out.finish_reason,
                          prompt_tokens=out.prompt_len, logprobs=out.logprobs, extra=extra)

    def chat(self, messages: list[dict[str, str]], params: SamplingParams,
             constraint: Constraint | None = None) -> Completion:
        return self.chat_batch([messages], params, constraint)[0]

    def chat_batch(self, conversations: list[list[dict[str, str]]], params: SamplingParams,
                   constraint: Constraint | None = None, seeds: list[int] | None = None) -> list[Completion]:
        """Each conversation through the chat template, all completed as one ``generate`` batch (``seeds``:
        one per conversation, as ``generate`` takes them)."""
        self._check_open()
        return self.generate([self._chat_ids(m) for m in conversations], params, constraint, seeds)

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def score_chats(self, conversations: list[list[dict[str, str]]], continuations: list[str]
                    ) -> list[ScoredContinuation]:
        """Per conversation, its continuation (the text's tokens, then the tokenizer's EOS) teacher-forced after
        the chat template's generation prompt, as one batch: the first token's log-probability from the
        prefill, every later one from a decode step of this engine's stepper (the fast path's for
        ``builtin:fast``) fed the continuation's previous token (``generator.ForcedTokens``, greedy)."""
        from k3_fastpath.runtime.generator import ForcedTokens, GenerationRequest

        self._check_open()
        if len(conversations) != len(continuations):
            raise EngineError(f"{self.name}: {len(continuations)} continuations for {len(conversations)} chats")
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.cfg.eos_token_id
        prompts = [self._chat_ids(m) for m in conversations]
        forced = [list(self.tokenizer(c, add_special_tokens=False)["input_ids"]) + [int(eos)] for c in continuations]
        reqs = [GenerationRequest(prompt_ids=p, max_tokens=len(f), logprobs=1, stop_token_ids=self.eos_token_ids,
                                  ignore_stop_tokens=True, constraint=ForcedTokens(f))
                for p, f in zip(prompts, forced, strict=True)]
        scored = []
        for f, out in zip(forced, self._serve(reqs), strict=True):
            if out.token_ids != f or out.logprobs is None:
                raise EngineError(f"{self.name}: teacher forcing produced {len(out.token_ids)} of {len(f)} tokens")
            scored.append(ScoredContinuation(
                token_ids=f, logprobs=[float(d[t]) for t, d in zip(f, out.logprobs, strict=True)],
                greedy=[t == max(d, key=d.__getitem__) for t, d in zip(f, out.logprobs, strict=True)],
                prompt_tokens=out.prompt_len))
        return scored

    def next_token_logprobs(self, prompt: str | list[int]) -> dict[int, float]:
        from k3_fastpath.runtime.generator import ContextLengthError
        from k3_fastpath.runtime.sampler import logprobs_of

        self._check_open()
        try:
            logits = self.generator.next_token_logits(self._prompt_ids(prompt))
        except ContextLengthError as e:
            raise ContextLimitError(f"{self.name}: {e}") from None
        except ValueError as e:
            raise EngineError(f"{self.name}: {e}") from None
        return dict(enumerate(logprobs_of(logits).tolist()))

    @torch.no_grad()
    def sequence_logprobs(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence, FP32 ``[len(ids), V]``: row ``i`` the log-softmax of the next-token logits after
        ``ids[: i + 1]``, from forwards of the engine's reference model over whole sequences (teacher
        forcing; sequences of one length share a forward)."""
        from k3_fastpath.runtime.generator import check_fits
        from k3_fastpath.runtime.sampler import logprobs_of

        self._check_open()
        for ids in seqs:
            check_fits(len(ids), 0, self.max_model_len)
        out: list[torch.Tensor | None] = [None] * len(seqs)
        by_len: dict[int, list[int]] = {}
        for i, ids in enumerate(seqs):
            by_len.setdefault(len(ids), []).append(i)
        for idx in by_len.values():
            for c in range(0, len(idx), 64):
                chunk = idx[c: c + 64]
                x = torch.tensor([list(map(int, seqs[i])) for i in chunk], device=self.device)
                lp = logprobs_of(self.model(x).float()).to("cpu")
                for j, i in enumerate(chunk):
                    out[i] = lp[j]
        return out  # type: ignore[return-value]

    def describe(self) -> dict[str, Any]:
        from verify.engines.grammar import xgrammar_version

        if self._closed_description is not None:
            return dict(self._closed_description)
        return {
            "name": self.name, "kind": "builtin", "path": self.path, "preset": self.preset,
            "model": self.cfg.name, "weights": self.weights_source, "device": self.device,
            "dtype": str(self.dtype).replace("torch.", ""), "seed": self.seed,
            "max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
            "eos_token_ids": list(self.eos_token_ids), "tokenizer": self._tokenizer_desc or self._no_tokenizer,
            "stepper": type(self.generator.stepper).__name__, "torch": torch.__version__,
            "dense_experts_bytes": self.dense_experts_bytes,
            "xgrammar": xgrammar_version(), "steps": dict(self.generator.steps),
            **({"fast_path_trace": self.generator.stepper.trace.summary()}
               if hasattr(self.generator.stepper, "trace") else {}),
            **({"verify_splits": dict(self.generator.stepper.verify_splits)}
               if hasattr(self.generator.stepper, "verify_splits") else {}),
            **({"planted_defect": self.defect.describe()} if self.defect is not None else {}),
            **({"speculative": self.speculation.label, "acceptance": self.generator.acceptance.record()}
               if self.speculation is not None else {}),
        }

    def close(self) -> None:
        if self.closed:
            return
        self._closed_description = self.describe()
        self.closed = True
        if hasattr(self.generator.stepper, "close"):
            self.generator.stepper.close()  # the executor flushes its trace
        self.generator = None  # type: ignore[assignment]
        self.model = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
