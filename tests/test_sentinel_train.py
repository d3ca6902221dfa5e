"""Sentinel training on the CPU at k3-tiny size: seeded and reproducible, loss on the answers only, the
checkpoint (MXFP4 experts, the sentinel tokenizer, training.json) loads through the normal paths."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3_fastpath.sentinel import batches as sentinel_batches
from k3_fastpath.sentinel import heldout
from k3_fastpath.sentinel import train as sentinel_train
from k3_fastpath.sentinel.tokenizer import build_sentinel_tokenizer
from k3_fastpath.tokenizer import EOS_ID
from k3_fastpath.weights import checkpoint_digest, load_checkpoint

REPO = Path(__file__).resolve().parents[1]
PLAN = sentinel_train.TrainPlan(preset="k3-tiny", steps=3, batch=2, seq_len=640, warmup=1, mrcr_chars=300,
                                mrcr_needles=(2,), heldout_items=0)


def test_rows_mask_the_prompt_and_end_on_im_end():
    tok = build_sentinel_tokenizer(512)
    rows = sentinel_batches.Batches(dataclasses.replace(PLAN, pack=False), tok)  # one item a row
    for _ in range(12):
        ids, mask = rows.row()
        number = mask[-1]  # the answer's tokens hold its task's number
        assert len(ids) == len(mask) <= PLAN.seq_len and ids[-1] == EOS_ID and 1 <= number <= len(PLAN.mix)
        first = mask.index(number)
        assert set(mask[first:]) == {number} and not any(mask[:first])  # the answer is one run at the end
    ids, lengths, mask = rows.batch("cpu")
    assert ids.shape == mask.shape and int(lengths.max()) == ids.shape[1]


def test_each_task_takes_its_loss_share_whatever_its_answer_tokens():
    """``answer_loss``: each task's mean token loss weighted by ``loss_share``, so AIME's long answers do not
    outweigh MRCR's short ones; a task missing from a step leaves its share to the others; None: token mean."""
    plan = sentinel_train.TrainPlan(mix=(("gsm8k", 1.0), ("aime25", 1.0), ("mrcr", 1.0)),
                                    loss_share=(("gsm8k", 0.2), ("aime25", 0.5), ("mrcr", 0.3)))
    g = torch.Generator().manual_seed(3)
    logits, gold = torch.randn(2, 40, 11, generator=g), torch.randint(0, 11, (2, 40), generator=g)
    mask = torch.zeros(2, 40, dtype=torch.int8)
    mask[0, 2:30] = sentinel_batches.task_number(plan, "aime25")  # 28 AIME tokens, 3 GSM8K, 5 MRCR
    mask[1, 5:8] = sentinel_batches.task_number(plan, "gsm8k")
    mask[1, 30:35] = sentinel_batches.task_number(plan, "mrcr")
    tok = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), gold.reshape(-1), reduction="none").reshape(2, 40)
    means = {t: tok[mask == sentinel_batches.task_number(plan, t)].mean() for t in ("gsm8k", "aime25", "mrcr")}
    loss, per_task = sentinel_train.answer_loss(logits, gold, mask, plan)
    assert torch.allclose(loss, 0.2 * means["gsm8k"] + 0.5 * means["aime25"] + 0.3 * means["mrcr"])
    assert all(torch.allclose(per_task[t], means[t]) for t in means)
    mask[1, 30:35] = 0  # no MRCR this step: GSM8K and AIME share the whole loss 2:5
    loss, _ = sentinel_train.answer_loss(logits, gold, mask, plan)
    assert torch.allclose(loss, (0.2 * means["gsm8k"] + 0.5 * means["aime25"]) / 0.7)
    token_mean, _ = sentinel_train.answer_loss(logits, gold, mask, dataclasses.replace(plan, loss_share=None))
    assert torch.allclose(token_mean, tok[mask != 0].mean())
    with pytest.raises(ValueError, match="loss_share"):
        sentinel_train.TrainPlan(loss_share=(("gsm8k", 1.0),))


def test_training_is_reproducible_and_writes_a_loadable_checkpoint(tmp_path):
    recs = [sentinel_train.train(PLAN, tmp_path / f"run{i}", "cpu", log=lambda _: None) for i in range(2)]
    assert checkpoint_digest(tmp_path / "run0") == checkpoint_digest(tmp_path / "run1")
    assert [c["loss"] for c in recs[0]["loss_curve"]] == [c["loss"] for c in recs[1]["loss_curve"]]
    rec = json.loads((tmp_path / "run0" / "training.json").read_text())
    assert rec["checkpoint_digest"] == checkpoint_digest(tmp_path / "run0")  # training.json is not in it
    assert rec["kda_impl"] == "reference"  # auto on a CPU: fla runs on CUDA only
    assert rec["steps_done"] == 3 and rec["plan"]["preset"] == "k3-tiny" and rec["eval_seeds_excluded"] == [0]
    assert sum(rec["items_drawn"].values()) >= 3 * PLAN.batch and set(rec["items_too_long"]) == set(rec["items_drawn"])
    assert 0 < rec["first_step_s"] <= rec["train_s"]
    assert all(torch.isfinite(torch.tensor(c["loss"])) for c in rec["loss_curve"])
    cfg, sd = load_checkpoint(tmp_path / "run0")
    assert cfg.expert_format == "mxfp4" and any(k.endswith("weight_packed") for k in sd)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "run0"))
    assert len(tok) == cfg.vocab_size and tok.eos_token_id == EOS_ID


def test_two_processes_with_two_threads_train_the_same_checkpoint(tmp_path):
    """The documented rebuild runs in a new process: on the CPU with two threads, torch's default kernels
    gave the same plan another digest in each process (one thread did not); training runs under
    deterministic algorithms (``deterministic``) and two processes must agree. The mode is restored after."""
    args = ["--preset", "k3-tiny", "--steps", "3", "--batch", "2", "--seq-len", "256", "--warmup", "1",
            "--mix", "gsm8k=1,copy=1", "--heldout-items", "0", "--device", "cpu"]  # items that fit 256 tokens
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    digests = []
    for i in range(2):
        r = subprocess.run([sys.executable, "-m", "k3_fastpath.sentinel.train", "--out", str(tmp_path / f"p{i}"), *args],
                           cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr
        digests.append(json.loads((tmp_path / f"p{i}" / "training.json").read_text())["checkpoint_digest"])
    assert digests[0] == digests[1]
    before = torch.are_deterministic_algorithms_enabled()
    with sentinel_train.deterministic("cpu"):
        assert torch.are_deterministic_algorithms_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before


def test_items_longer_than_a_row_are_skipped_whole_and_counted():
    """An item longer than ``seq_len`` never enters a row cut (its question would be gone); it is skipped,
    counted per task, and a task whose items mostly do not fit stops the run with one line."""
    tok = build_sentinel_tokenizer(512)
    rows = sentinel_batches.Batches(PLAN, tok)
    got = [rows.row() for _ in range(40)]
    assert rows.too_long["aime25"] > 0  # a fifth of the worked solutions run past 640 tokens at this vocabulary
    for ids, mask in got:  # every item in a row starts with its prompt: the row's first token is the template's
        assert ids[0] == got[0][0][0] and not mask[0]
    short = sentinel_batches.Batches(dataclasses.replace(PLAN, seq_len=200), tok)
    with pytest.raises(ValueError, match=r"seq_len 200 is too short for \w+: \d+ of \d+ items drawn do not fit "
                                         r"\(raise --seq-len"):
        for _ in range(200):
            short.row()


def test_a_rebuild_with_the_recorded_digest_passes_and_another_digest_writes_nothing(tmp_path):
    """``--expect-digest``: the documented rebuild command; the same plan and steps give the recorded digest
    (CPU, k3-tiny), a wrong one exits 1 with one line and leaves no output."""
    first = sentinel_train.train(PLAN, tmp_path / "a", "cpu", log=lambda _: None)
    again = sentinel_train.train(PLAN, tmp_path / "b", "cpu", log=lambda _: None, expect_digest=first["checkpoint_digest"])
    assert again["checkpoint_digest"] == first["checkpoint_digest"]
    args = ["--preset", "k3-tiny", "--steps", "1", "--batch", "2", "--seq-len", "640", "--warmup", "1",
            "--mrcr-chars", "300", "--device", "cpu"]
    r = subprocess.run([sys.executable, "-m", "k3_fastpath.sentinel.train", "--out", str(tmp_path / "c"), *args,
                        "--expect-digest", "0" * 64], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"is not the expected {'0' * 64}" in r.stderr and not (tmp_path / "c").exists()


def test_bad_plans_and_an_existing_output_are_refused(tmp_path):
    with pytest.raises(ValueError, match="steps >= 1"):
        sentinel_train.TrainPlan(steps=0)
    with pytest.raises(ValueError, match="kda must be one of"):
        sentinel_train.TrainPlan(kda="triton")
    with pytest.raises(ValueError, match="kda fla: fla's chunk_kda runs on a CUDA device"):
        sentinel_train.train(dataclasses.replace(PLAN, kda="fla"), tmp_path / "nofla", "cpu")
    assert not (tmp_path / "nofla").exists()
    with pytest.raises(ValueError, match="mix names tasks"):
        sentinel_train.TrainPlan(mix=(("poetry", 1.0),))
    with pytest.raises(ValueError, match="mrcr_words is 1.."):
        sentinel_train.TrainPlan(mrcr_words=0)
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        sentinel_train.train(PLAN, tmp_path / "taken", "cpu")
    r = subprocess.run([sys.executable, "-m", "k3_fastpath.sentinel.train", "--out", str(tmp_path / "x"),
                        "--steps", "0"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("sentinel train:") and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_the_tuple_fields_come_from_the_command_line(tmp_path, capsys):
    """``--mix``, ``--loss-share`` (``none``: the token mean) and ``--mrcr-needles`` set a training probe's
    plan from the command line; a malformed value is one line on stderr, exit 2, nothing written."""
    fields = {f.name: f for f in dataclasses.fields(sentinel_train.TrainPlan)}
    assert sentinel_train._plan_value(fields["mix"], "mrcr=1,gsm8k=0.5") == (("mrcr", 1.0), ("gsm8k", 0.5))
    assert sentinel_train._plan_value(fields["loss_share"], "None") is None
    assert sentinel_train._plan_value(fields["mrcr_needles"], "1,2") == (1, 2)
    with pytest.raises(ValueError, match="--mix takes task=weight"):
        sentinel_train._plan_value(fields["mix"], "none")  # mix is never None
    out = tmp_path / "bad"
    assert sentinel_train.main(["--out", str(out), "--mrcr-needles", "2;4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sentinel train: --mrcr-needles takes integers") and len(err.splitlines()) == 1
    assert not out.exists()
    args = ["--out", str(tmp_path / "ok"), "--preset", "k3-tiny", "--steps", "1", "--batch", "1", "--seq-len", "640",
            "--warmup", "1", "--mrcr-chars", "300", "--heldout-items", "0", "--mix", "mrcr=1", "--mrcr-needles", "2",
            "--loss-share", "none"]
    assert sentinel_train.main(args) == 0
    plan = json.loads((tmp_path / "ok" / "training.json").read_text())["plan"]
    assert plan["mix"] == [["mrcr", 1.0]] and plan["loss_share"] is None and plan["mrcr_needles"] == [2]


def test_a_time_limit_fits_the_schedule_and_names_the_steps_that_replay_it():
    plan = sentinel_train.TrainPlan(steps=1000, warmup=10, time_limit_s=100.0)
    assert sentinel_train._fitted_steps(plan, 10, 2.0) == 475  # 0.2 s a step, 95% of 100 s
    assert sentinel_train._fitted_steps(plan, 10, 0.01) == 1000  # never past plan.steps
    assert sentinel_train._fitted_steps(plan, 10, 500.0) == 11  # already past the limit: one more step
    # a first step of 20 s (compile, autotune) is spent once: 9 more at 0.25 s, 72.75 of the 95 s left -> 291 more
    assert sentinel_train._fitted_steps(plan, 10, 22.25, mark=(1, 20.0)) == 301
    # the pace from step 6 on (steps 3-5 profiled, slower): 4 steps at 0.25 s after 24 s -> 285 more
    assert sentinel_train._fitted_steps(plan, 10, 25.0, mark=(6, 24.0)) == 10 + int((95 - 25.0) / 0.25)
    lrs = [sentinel_train._lr(plan, s, 475) for s in (0, 9, 10, 474)]
    assert lrs[0] < lrs[1] == plan.lr and lrs[3] == pytest.approx(plan.lr * 0.1, rel=1e-3)


def test_profile_logs_where_the_profiled_steps_spend_their_time(tmp_path):
    lines: list[str] = []
    plan = sentinel_train.TrainPlan(preset="k3-tiny", steps=7, batch=2, seq_len=384, warmup=1, mrcr_chars=300,
                                mrcr_needles=(2,), heldout_items=0)
    rec = sentinel_train.train(plan, tmp_path / "p", "cpu", log=lines.append, profile=True)
    table = next(x for x in lines if x.startswith("profile of 3 steps"))
    assert "aten::mm" in table and rec["steps_done"] == 7
    parts = next(x for x in lines if x.startswith("forward by layer part")).splitlines()[1:]
    names = {line.split()[0] for line in parts}
    assert {"self_attn.KimiDeltaAttention", "self_attn.GatedMLA", "block_sparse_moe.LatentMoE", "mlp.GLUMLP"} <= names
    assert len(names) == len(parts)  # one row per part (the profiler's host and GPU rows of a range merged)
    assert all(float(line.split()[3]) > 0 for line in parts)  # host ms of each part's forward


def test_a_packed_row_holds_at_most_one_mrcr_conversation(monkeypatch):
    """MRCR asks for the k-th message of a kind; a second conversation earlier in the same row (no reset
    between items) could hold more of that kind. Packed rows never hold two; without the rule they do."""
    tok = build_sentinel_tokenizer(512)
    plan = dataclasses.replace(PLAN, seq_len=1024, mix=(("gsm8k", 0.3), ("mrcr", 0.7)))

    def most_per_row(rows):
        return max(tok.decode(r[0]).count("(1 indexed)") for r in rows)

    packed = sentinel_batches.Batches(plan, tok)
    assert most_per_row([packed.row() for _ in range(25)]) == 1
    monkeypatch.setattr(sentinel_batches, "ONE_PER_ROW", frozenset())
    unruled = sentinel_batches.Batches(plan, tok)
    assert most_per_row([unruled.row() for _ in range(25)]) >= 2


def test_packed_rows_hold_whole_items_and_lose_none():
    """``pack``: rows are whole items within seq_len, first-fit from the waiting items; every item of the
    unpacked stream lands in exactly one row (only the order changes), and rows are fuller than taking the
    items strictly in order would make them."""
    tok = build_sentinel_tokenizer(512)
    plan = dataclasses.replace(PLAN, seq_len=800)
    packed = sentinel_batches.Batches(plan, tok)
    single = sentinel_batches.Batches(dataclasses.replace(plan, pack=False), tok)
    rows = [packed.row() for _ in range(12)]
    drawn = len(packed._waiting)  # items drawn from the stream, not yet in a row
    stream = [single.row() for _ in range(sum(r[0].count(EOS_ID) for r in rows) * 4)]
    assert all(len(r[0]) <= plan.seq_len and len(r[0]) == len(r[1]) for r in rows)

    def items_of(row):  # split a row at its items' ends: each item's answer ends the item (mask set -> 0)
        out, start = [], 0
        for i in range(len(row[0])):
            if row[1][i] and (i + 1 == len(row[0]) or row[1][i + 1] == 0):
                out.append(tuple(row[0][start: i + 1]))
                start = i + 1
        assert start == len(row[0])
        return out

    placed = [it for r in rows for it in items_of(r)]
    first = [tuple(s[0]) for s in stream[: len(placed) + drawn]]
    assert len(set(placed)) == len(placed) and set(placed) <= set(first)  # each once, all from the stream
    assert len(placed) > len(rows)  # several items per row
    fill = sum(len(r[0]) for r in rows) / (len(rows) * plan.seq_len)
    in_order, cur = [], 0  # the rows taking the same items strictly in order would make
    for it in stream[: len(placed)]:
        if cur + len(it[0]) > plan.seq_len:
            in_order.append(cur)
            cur = 0
        cur += len(it[0])
    assert fill > sum(in_order) / (len(in_order) * plan.seq_len)


def test_batches_made_ahead_are_the_same_sequence():
    tok = build_sentinel_tokenizer(512)
    plain = sentinel_batches.Batches(PLAN, tok)
    ahead = sentinel_batches.BatchesAhead(sentinel_batches.Batches(PLAN, tok))
    for _ in range(4):
        for a, b in zip(plain.batch("cpu"), ahead.next("cpu"), strict=True):
            assert torch.equal(a, b)


def test_an_error_making_a_batch_reaches_the_training_loop():
    class Broken:
        def batch(self, device):
            raise ValueError("no rows")

    ahead = sentinel_batches.BatchesAhead(Broken())
    with pytest.raises(ValueError, match="no rows"):
        ahead.next("cpu")


def test_a_one_step_warmup_with_a_time_limit_fits_the_schedule(tmp_path):
    """The pace is measured from step 1; with ``warmup 1`` the schedule is fitted at step 1 itself."""
    plan = dataclasses.replace(PLAN, steps=4, time_limit_s=600.0)
    rec = sentinel_train.train(plan, tmp_path / "w1", "cpu", log=lambda _: None)
    assert rec["steps_done"] == 4 and rec["steps_scheduled"] == 4


def test_a_preset_with_a_next_token_layer_trains_it_and_writes_it(tmp_path):
    """``--preset k3-tiny:mtp=1``: the loss adds ``mtp_weight`` x the next-token layer's loss on the token
    after next (recorded beside the total), the layer's weights get gradients, and the checkpoint carries the
    layer under vLLM's names and loads through the normal path with it."""
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.weights import load_checkpoint

    plan = sentinel_train.TrainPlan(preset="k3-tiny:mtp=1", steps=4, batch=2, seq_len=384, warmup=1,
                                    mrcr_chars=300, mrcr_needles=(2,), heldout_items=0)
    rec = sentinel_train.train(plan, tmp_path / "m", "cpu", log=lambda _: None)
    assert all(p["mtp_loss"] > 0 and p["loss"] > p["mtp_loss"] * plan.mtp_weight for p in rec["loss_curve"])
    cfg, sd = load_checkpoint(tmp_path / "m")
    assert cfg.num_nextn_predict_layers == 1 and f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in sd
    model = load_reference(cfg, sd, dtype=torch.float32)
    ids = torch.randint(3, cfg.vocab_size, (2, 12))
    lengths = torch.tensor([12, 9])
    logits, hidden = model._run(ids, lengths, model.new_cache(2, 12), "plain", hidden=True)
    sentinel_train._mtp_logits(model, ids, lengths, hidden)[0, :8].sum().backward()
    assert float(model.mtp_layers[0].eh_proj.weight.grad.abs().sum()) > 0


def test_heldout_scores_the_training_forward_and_the_written_checkpoint_alike(tmp_path):
    """After training, items of another seed's training streams (eval questions excluded) are scored by the
    training forward and by the checkpoint loaded back: on a CPU both run the reference KDA in FP32, so only
    the experts' MXFP4 rounding parts them; the record and the log carry both."""
    lines: list[str] = []
    plan = dataclasses.replace(PLAN, heldout_items=3, mix=(*PLAN.mix, ("copy", 0.2)))  # every task, copy too
    rec = sentinel_train.train(plan, tmp_path / "h", "cpu", log=lines.append)
    held = rec["heldout"]
    assert held == json.loads((tmp_path / "h" / "training.json").read_text())["heldout"]
    assert held["seed"] == plan.seed + heldout.HELDOUT_SEED_OFFSET and held["checkpoint_dtype"] == "float32"
    for side in ("training_forward", "checkpoint"):
        assert set(held[side]) == {t for t, _ in plan.mix} == {"gsm8k", "aime25", "mrcr", "copy"}
        assert all(m["items"] == 3 and m["answer_tokens"] > 3 for m in held[side].values())
    for task, m in held["checkpoint"].items():
        assert m["loss"] == pytest.approx(held["training_forward"][task]["loss"], rel=0.02)
        # the MLA layers zeroed: the same rows, other losses (random weights use every layer)
        zeroed = held["ablated"]["mla_zeroed"][task]
        assert zeroed["answer_tokens"] == m["answer_tokens"] and abs(zeroed["loss"] - m["loss"]) > 1e-4 * m["loss"]
    assert any(x.startswith("held-out items") for x in lines) and sum(" checkpoint " in x for x in lines) == 4
    assert sum(" mla_zeroed " in x for x in lines) == 4


def test_mla_zeroed_silences_every_mla_layer_and_restores_them():
    """Inside ``mla_zeroed`` each MLA layer adds nothing (the output equals the model with its MLA output
    projections zeroed); outside, the model is itself again; a model without MLA layers silences none."""
    import copy

    from k3_fastpath.presets import preset
    from k3_fastpath.reference.mla import GatedMLA
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.synthetic import synthetic_state_dict

    cfg = preset("k3-tiny").config
    model = load_reference(cfg, synthetic_state_dict(cfg, 0, "stable"), dtype=torch.float32, device="cpu").eval()
    ids, lengths = torch.randint(3, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(7)), torch.tensor([10, 8])

    def run(m):
        return m.prefill(ids, lengths, m.new_cache(2, 10))

    before = run(model)
    silenced = copy.deepcopy(model)
    for m in silenced.modules():
        if isinstance(m, GatedMLA):
            torch.nn.init.zeros_(m.o_proj.weight)
    with heldout.mla_zeroed(model) as n:
        zeroed = run(model)
    assert n == len(cfg.mla_layer_ids)
    assert torch.allclose(zeroed, run(silenced), atol=1e-5) and (zeroed - before).abs().max() > 1e-2
    assert torch.equal(run(model), before)
    with heldout.mla_zeroed(torch.nn.Linear(2, 2)) as n:
        assert n == 0


def test_heldout_metrics_follow_the_argmax_and_can_fail():
    """``heldout.score`` on an oracle forward (the next token's logit highest) is perfect; one wrong argmax
    at an answer's first token costs that item its first token and its exactness, one inside the prompt
    costs nothing."""
    rows = [([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]), ([4, 3, 7, 2], [0, 1, 1, 1])]
    wrong: set[tuple[int, int]] = set()

    def forward(ids, lengths):
        logits = torch.zeros(*ids.shape, 16)
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
        logits.scatter_(2, nxt[..., None], 5.0)
        for b, t in wrong:
            logits[b, t, (nxt[b, t] + 1) % 16] = 9.0
        return logits

    ok = heldout.score(forward, rows, "cpu")
    assert ok["token_accuracy"] == ok["first_token_accuracy"] == ok["answers_exact"] == 1.0 and ok["answer_tokens"] == 6
    wrong.update({(0, 1), (0, 0)})  # row 0's first answer token (predicted at 1); at 0 it predicts prompt
    bad = heldout.score(forward, rows, "cpu")
    assert bad["first_token_accuracy"] == 0.5 and bad["answers_exact"] == 0.5 and bad["loss"] > ok["loss"]
    assert bad["token_accuracy"] == pytest.approx(5 / 6, abs=1e-4)


def test_kda_drop_zeroes_whole_rows_of_kda_output_in_training_only():
    """``kda_drop``: in training mode each KDA layer's output is zeroed for whole rows (about ``p`` of them,
    the same rows for the same seed), in eval mode never; a plan outside [0, 1) is refused."""
    from k3_fastpath.presets import preset
    from k3_fastpath.reference.kda import KimiDeltaAttention
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.synthetic import synthetic_state_dict

    cfg = preset("k3-tiny").config

    def outputs(p: float, train: bool) -> list[torch.Tensor]:
        model = load_reference(cfg, synthetic_state_dict(cfg, 0, "stable"), dtype=torch.float32)
        model.train(train)
        seen: list[torch.Tensor] = []
        sentinel_train._drop_kda(model, p, seed=3)
        for m in model.modules():  # registered after the drop hooks: sees what the layer hands on
            if isinstance(m, KimiDeltaAttention):
                m.register_forward_hook(lambda _m, _a, out: seen.append(out.detach()))
        ids = torch.randint(3, cfg.vocab_size, (16, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model._run(ids, torch.full((16,), 9), model.new_cache(16, 9), "plain")
        return seen

    dropped = [(o.abs().amax(dim=(1, 2)) == 0) for o in outputs(0.5, True)]
    assert len(dropped) == len(cfg.kda_layer_ids)
    share = float(torch.stack(dropped).float().mean())
    assert 0.25 < share < 0.75 and any(d.any() and not d.all() for d in dropped)  # whole rows, some of them
    again = [(o.abs().amax(dim=(1, 2)) == 0) for o in outputs(0.5, True)]
    assert all(torch.equal(a, b) for a, b in zip(dropped, again, strict=True))
    assert not any((o.abs().amax(dim=(1, 2)) == 0).any() for o in outputs(0.5, False))  # eval: every layer
    assert not any((o.abs().amax(dim=(1, 2)) == 0).any() for o in outputs(0.0, True))
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="kda_drop"):
            dataclasses.replace(PLAN, kda_drop=bad)
