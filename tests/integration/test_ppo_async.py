"""PPO with role overrides under both async schedules, through the real CLI, each killed after a checkpoint and
resumed (Ray, the real router, fake engines, megatron-core on CPU; critic and actor on one logical GPU).

What must hold beyond the GRPO async runs (`test_async_train.py`): the critic trains every step on exactly the
groups the actor consumes (their train-data hashes agree per rollout), each role with its `--megatron-config`
learning rate; the critic resumes from its own checkpoint of the actor's rollout; the staleness rules are those
of the schedule (one step ahead: every batch one version old; fully async: within the bound); no prompt is lost
or trained twice across the kill; and the resumed run's events are the one loop's documented order.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch

from slime.arguments import parse_args
from slime.backends.megatron.roles import role_args
from slime.scheduling.loop import LoopPlan
from tests.integration.test_async_train import BATCH, N, _dump, _records, base_flags, moved
from tests.integration.test_resume import assets, run_slime  # noqa: F401 - `assets` is a module fixture
from tests.loop_order import expected_events

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

LR = {"actor": 2e-3, "critic": 1e-2}


def ppo_flags(assets: Path, run: Path, ckpt: Path, roles: Path, num_rollout: int) -> list[str]:  # noqa: F811
    flags = base_flags(assets, run, ckpt, num_rollout)
    flags[flags.index("reinforce_plus_plus")] = "ppo"
    return [*flags, "--megatron-config", str(roles), "--gamma", "0.99", "--lambd", "0.95"]


def write_roles(path: Path, actor_ckpt: Path | None = None) -> Path:
    """Each role's learning rate; with `actor_ckpt`, the actor's checkpoint dirs too (the critic's stay under them)."""
    dirs = f", save: {actor_ckpt}, load: {actor_ckpt}" if actor_ckpt else ""
    path.write_text(
        "megatron:\n"
        f"  - {{name: default, role: actor, overrides: {{lr: {LR['actor']}{dirs}}}}}\n"
        f"  - {{name: default, role: critic, overrides: {{lr: {LR['critic']}}}}}\n"
    )
    return path


def role_hashes(run: Path, role: str) -> dict[int, str]:
    """{rollout id: data hash} from the role's rank-0 log (`TrainRayActor.train` logs every rollout it trains)."""
    log = (run / "metrics" / "logs" / f"{'train' if role == 'actor' else role}_rank0.log").read_text()
    return {int(r): h for r, h in re.findall(rf"{role} rank 0 rollout (\d+): \d+ samples, hash (\w+)", log)}


def check_ppo_trained(run: Path, rollouts: range) -> None:
    """Critic and actor trained every rollout of `rollouts` (a killed run may have trained one more), on the same
    data, at their own learning rates."""
    critic, actor = role_hashes(run, "critic"), role_hashes(run, "actor")
    assert set(rollouts) <= set(actor) and critic == actor, (critic, actor)
    for r in _records(run, "train"):
        m = r["metrics"]
        assert m["critic/lr"] == LR["critic"] and m["train/lr"] == LR["actor"], m
        assert m["critic/value_loss"] >= 0 and 0 <= m["critic/value_clipfrac"] <= 1


def resumed_events(flags: list[str], start: int) -> list[tuple[str, int]]:
    """The one loop's documented order for the resumed run (the actor's args, as the driver plans it)."""
    return expected_events(LoopPlan.from_args(role_args(parse_args(flags), "actor"), start))


def test_ppo_one_step_ahead_killed_after_a_checkpoint_resumes_losslessly(assets, tmp_path):  # noqa: F811
    rollouts = 4
    b, c, ckpt = tmp_path / "B", tmp_path / "C", tmp_path / "ckpt"
    roles = write_roles(tmp_path / "roles.yaml")
    flags = [*ppo_flags(assets, b, ckpt, roles, rollouts), "--sim-engine", "hf", "--one-step-ahead"]
    rc = run_slime(flags, b, kill_when=ckpt / "iter_0000002.tmp")  # checkpoint 1 is complete, 2 is being written
    assert rc == -signal.SIGKILL
    assert (ckpt / "critic" / "iter_0000001" / "slime_checkpoint.json").is_file()  # the critic saved first
    pending = torch.load(ckpt / "iter_0000001" / "rollout" / "pending_1.pt", weights_only=False)
    assert list(pending) == [2]

    resumed = [*moved(flags, b, c), "--load", str(ckpt)]
    run_slime(resumed, c)
    summary = json.loads((c / "metrics" / "summary.json").read_text())
    assert summary["resumed_from"] == 1
    assert [tuple(e) for e in summary["events"]] == resumed_events(resumed, 2)
    critic_log = (c / "metrics" / "logs" / "critic_rank0.log").read_text()
    assert "resumed from" in critic_log and str(ckpt / "critic" / "iter_0000001") in critic_log
    check_ppo_trained(b, range(2))
    check_ppo_trained(c, range(2, rollouts))
    prompts = [s["group_index"] for rid in (0, 1) for s in _dump(b, rid) if s["index"] % N == 0]
    prompts += [s["group_index"] for rid in range(2, rollouts) for s in _dump(c, rid) if s["index"] % N == 0]
    assert sorted(prompts) == list(range(rollouts * BATCH)), "a prompt was lost or trained twice"
    for m in (r["metrics"] for r in _records(c, "rollout")):
        assert m["async/staleness_max"] == 1.0  # every batch one weight version old, as without a critic


def test_ppo_fully_async_killed_with_groups_in_flight_resumes_losslessly(assets, tmp_path):  # noqa: F811
    cfg = tmp_path / "synthetic.yaml"
    cfg.write_text("output_len: {dist: uniform, low: 4, high: 8}\ntoken_latency_s: {dist: fixed, value: 0.3}\n")
    rollouts, k = 5, 1
    b, c, ckpt = tmp_path / "B", tmp_path / "C", tmp_path / "ckpt"
    actor_ckpt = ckpt / "actor"  # the actor's dirs from --megatron-config; the critic's default under them
    roles = write_roles(tmp_path / "roles.yaml", actor_ckpt)
    flags = [
        *ppo_flags(assets, b, ckpt, roles, rollouts), "--sim-engine", "synthetic", "--sim-synthetic-config", str(cfg),
        "--fully-async", "--max-weight-staleness", str(k), "--async-data-buffer-capacity-factor", "3",
    ]  # fmt: skip
    rc = run_slime(flags, b, kill_when=actor_ckpt / "iter_0000002.tmp")
    assert rc == -signal.SIGKILL
    state = json.loads((actor_ckpt / "iter_0000001" / "rollout" / "fully_async_1.json").read_text())
    assert state["in_flight"], "the checkpoint should hold groups in flight (the engines are slow on purpose)"
    assert not (ckpt / "iter_0000001").exists()  # the command line's --save is not the actor's dir here

    resumed = [*moved(flags, b, c), "--load", str(ckpt)]
    run_slime(resumed, c)
    summary = json.loads((c / "metrics" / "summary.json").read_text())
    assert summary["resumed_from"] == 1
    assert [tuple(e) for e in summary["events"]] == resumed_events(resumed, 2)
    critic_log = (c / "metrics" / "logs" / "critic_rank0.log").read_text()
    assert "resumed from" in critic_log and str(actor_ckpt / "critic" / "iter_0000001") in critic_log
    check_ppo_trained(b, range(2))
    check_ppo_trained(c, range(2, rollouts))

    last = rollouts - 1
    final = json.loads((actor_ckpt / f"iter_{last:07d}" / "rollout" / f"fully_async_{last}.json").read_text())
    source = json.loads(
        (actor_ckpt / f"iter_{last:07d}" / "rollout" / f"global_dataset_state_dict_{last}.json").read_text()
    )
    consumed = final["consumed_ids"]
    assert consumed[: len(state["consumed_ids"])] == state["consumed_ids"]
    assert len(consumed) == len(set(consumed)) == rollouts * BATCH, "a prompt trained twice"

    def indices(groups: list) -> list[int]:
        return [(g[0][0] if isinstance(g[0], list) else g[0])["group_index"] for g in groups]

    everything = consumed + final["dropped_ids"] + indices(final["buffer"]) + indices(final["in_flight"])
    everything += indices(source["buffer"])
    assert len(everything) == len(set(everything)) and set(everything) == set(range(source["sample_group_index"]))
    for m in (r["metrics"] for r in _records(c, "rollout")):
        assert m["async/staleness_max"] <= k
