"""perf.serving's sub-agent fan-out (verify/aiperf.add_subagents) on a hand-made mooncake trace: children
start from the parent's shared prefix (the same hash ids: the same text, so the server can reuse its KV)
plus blocks of their own, every token count matches its blocks, no hash id is reused, the parent waits on
its children, and bad settings are refused. AIPerf replaying such a trace against vLLM-CPU is in
tests/integration/test_vllm_server.py."""

from __future__ import annotations

import pytest

from verify.aiperf import SUBAGENT_MARK, Workload, add_subagents

BLOCK = 16


def _trace() -> list[dict]:
    rows = []
    for s, (start, turns) in enumerate([(0.0, 7), (50.0, 3)]):
        sid = f"sess-{s}"
        rows.append({"session_id": sid, "input_length": 150, "output_length": 24, "timestamp": start,
                     "hash_ids": list(range(100 * s, 100 * s + 10)), "group_id": 0})
        for t in range(1, turns):
            rows.append({"session_id": sid, "input_length": 20, "output_length": 24, "delay": 100.0 * t,
                         "hash_ids": [1000 + 100 * s + 2 * t, 1001 + 100 * s + 2 * t]})
    return rows


def test_children_share_the_parents_prefix_and_the_parent_waits():
    rows = _trace()
    out = add_subagents(rows, fanout=2, every=3, turns=2, turn_tokens=40, block=BLOCK)
    children = [r for r in out if SUBAGENT_MARK in r["session_id"]]
    firsts = [r for r in children if "timestamp" in r]
    # sess-0 (7 turns) fans out after turns 3 and 6; sess-1 (3 turns) only after its last: none
    assert sorted({r["session_id"] for r in firsts}) == ["sess-0-sub2.0", "sess-0-sub2.1", "sess-0-sub5.0", "sess-0-sub5.1"]
    assert len(children) == 8 and all(len([r for r in children if r["session_id"] == c["session_id"]]) == 2 for c in firsts)
    for c in firsts:
        assert c["hash_ids"][:9] == list(range(9)) and len(c["hash_ids"]) == 11  # 150 tokens: 9 whole blocks shared
        assert c["group_id"] == 0
    assert all(r["input_length"] == len(r["hash_ids"]) * BLOCK for r in children)
    own = [h for r in children for h in (r["hash_ids"][9:] if "timestamp" in r else r["hash_ids"])]
    every_parent_id = {h for r in rows for h in r["hash_ids"]}
    assert len(own) == len(set(own)) and not set(own) & every_parent_id
    # scheduled together after the parent's pauses so far; the parent's next pause grows by the children's
    # one later turn at the parent's median pause (400 ms of 100..600)
    assert [c["timestamp"] for c in firsts] == [300.0, 300.0, 1900.0, 1900.0]
    parent = [r for r in out if r["session_id"] == "sess-0"]
    assert [r.get("delay") for r in parent] == [None, 100.0, 200.0, 700.0, 400.0, 500.0, 1000.0]
    assert all(r["delay"] == 400.0 for r in children if "delay" in r)
    assert [r for r in out if r["session_id"] == "sess-1"] == [r for r in rows if r["session_id"] == "sess-1"]
    assert rows == _trace()  # the input is not modified


def test_bad_fan_out_settings_are_refused():
    with pytest.raises(ValueError, match="fanout 0, every 3, turns 2 must each be >= 1"):
        add_subagents(_trace(), fanout=0, every=3, turns=2, turn_tokens=40, block=BLOCK)
    with pytest.raises(ValueError, match="with fields"):
        Workload.from_dict({"name": "a", "kind": "agentic", "subagent": 2})
    assert Workload.from_dict({"name": "a", "kind": "agentic", "subagents": 2}).subagent_every == 4
