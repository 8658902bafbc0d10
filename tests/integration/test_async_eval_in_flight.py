"""`slime train --fully-async --eval-interval 2 --update-weights-in-flight` through the real CLI (Ray, the real
router, slow synthetic engines, megatron-core on CPU), killed after a checkpoint and resumed.

- Evaluation runs in the background: each eval is logged with the weight version its engines served
  (`eval/weight_version` = the rollout id it ran before) and its requests run while training requests do (the
  producer is not paused for it).
- Weight syncs run in flight: every pause is SGLang's `in_place`, requests run through syncs (started before a
  pause, ended after its continue), no group is interrupted, and no trained token is older than the bound.
- The kill lands with requests in flight; the resumed run trains every prompt the checkpoint owed, none twice.
"""

from __future__ import annotations

import json
import signal

import pytest

from tests.integration.test_async_train import BATCH, _dump, _records, _requests, base_flags, moved
from tests.integration.test_resume import assets, run_slime  # noqa: F401,F811 - `assets` is a module fixture

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

EVAL_LEN = 5  # eval answers are capped below the training ones (8): their requests are told apart by it


def _generates(run, max_new_tokens: int) -> list[dict]:
    return [
        r for r in _requests(run)
        if r["endpoint"] == "/generate" and r["body"]["sampling_params"]["max_new_tokens"] == max_new_tokens
    ]  # fmt: skip


def test_background_eval_and_in_flight_updates_killed_and_resumed(assets, tmp_path):  # noqa: F811
    cfg = tmp_path / "synthetic.yaml"
    cfg.write_text("output_len: {dist: uniform, low: 4, high: 8}\ntoken_latency_s: {dist: fixed, value: 0.3}\n")
    rollouts, k = 5, 1
    b, c, ckpt = tmp_path / "B", tmp_path / "C", tmp_path / "ckpt"
    flags = [
        *base_flags(assets, b, ckpt, rollouts), "--sim-engine", "synthetic", "--sim-synthetic-config", str(cfg),
        "--fully-async", "--max-weight-staleness", str(k), "--async-data-buffer-capacity-factor", "3",
        "--update-weights-in-flight", "--async-unused-samples-handler", "mask",
        "--eval-prompt-data", "toy", str(assets / "data" / "eval.jsonl"), "--eval-interval", "2",
        "--eval-max-response-len", str(EVAL_LEN),
    ]  # fmt: skip
    rc = run_slime(flags, b, kill_when=ckpt / "iter_0000003.tmp")
    assert rc == -signal.SIGKILL
    state = json.loads((ckpt / "iter_0000002" / "rollout" / "fully_async_2.json").read_text())
    run_slime([*moved(flags, b, c), "--load", str(ckpt)], c)

    # background evals: at the version their engines served, beside training requests
    evals = {r["step"]: r["metrics"] for r in _records(b, "eval") + _records(c, "eval")}
    assert {0, 2, 4, 5} <= set(evals), sorted(evals)
    assert all(m["eval/weight_version"] == step for step, m in evals.items())
    for run in (b, c):
        train = _generates(run, 8)
        overlapping = [
            e for e in _generates(run, EVAL_LEN)
            if any(t["ts_start"] < e["ts_end"] and e["ts_start"] < t["ts_end"] for t in train)
        ]  # fmt: skip
        assert overlapping, "every eval request ran alone: the producer was paused for the eval"

    # in-flight syncs: paused in place, requests running through them, nothing interrupted
    requests = _requests(c)
    pauses = [r for r in requests if r["endpoint"] == "/pause_generation"]
    resumes = [r for r in requests if r["endpoint"] == "/continue_generation"]
    assert pauses and len(pauses) == len(resumes)
    assert all(p["body"] == {"mode": "in_place"} for p in pauses)
    assert not [r for r in requests if r["endpoint"] == "/flush_cache"]
    through = [
        g for g in _generates(c, 8)
        if any(g["ts_start"] < p["ts_start"] and g["ts_end"] > q["ts_end"] for p, q in zip(pauses, resumes, strict=True))
    ]  # fmt: skip
    assert through, "no request ran through a weight sync"
    rollout_metrics = [r["metrics"] for r in _records(c, "rollout")]
    assert sum(m["async/aborted_groups"] for m in rollout_metrics) == 0
    for rid in range(3, rollouts):
        for s in _dump(c, rid):
            spans = s["weight_version_spans"]
            assert [int(v) for v, _, _ in spans] == sorted(int(v) for v, _, _ in spans)
            assert all(rid - int(v) <= k for v, n, trained in spans if trained and n > 0)
            assert sum(s["loss_mask"] or [1] * s["response_length"]) == sum(n for _, n, on in spans if on)

    # the kill and the resume: every prompt the checkpoint owed trained once
    final = json.loads(
        (ckpt / f"iter_{rollouts - 1:07d}" / "rollout" / f"fully_async_{rollouts - 1}.json").read_text()
    )
    consumed = final["consumed_ids"]
    assert consumed[: len(state["consumed_ids"])] == state["consumed_ids"]
    assert len(consumed) == len(set(consumed)) == rollouts * BATCH, "a prompt trained twice"
