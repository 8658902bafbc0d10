"""The order of a run's events per schedule, as docs/architecture.md and docs/async.md state it: the oracle the
one loop is checked against, in the scheduling simulator and on Ray (`tests/property/test_one_loop.py`,
`tests/integration/test_resume.py`, `test_async_train.py`, `test_ppo_async.py`).

Written flat, one rule per line, so that a reader can hold it against the docs; the loop itself
(`slime/scheduling/loop.py`) is written for running it.
"""

from __future__ import annotations

from slime.scheduling.loop import LoopPlan


def expected_events(plan: LoopPlan) -> list[tuple[str, int]]:
    """(kind, id) in the order the loop records them for `plan`; `sync` carries the weight version."""
    out: list[tuple[str, int]] = []

    def sync_point(rollout_id: int, version: int | None) -> None:
        if plan.offload_rollout:
            out.append(("resume_weights", rollout_id))  # colocated: the engines' weights memory first
        if version is not None:
            out.append(("sync", version))
        if plan.offload_rollout:
            out.append(("resume_cache", rollout_id))  # then their KV cache

    if plan.sync_weights:
        sync_point(plan.start, plan.start)  # the engines get the trainer's weights before the first rollout
    if plan.mode == "fully_async":
        out.append(("start_producer", plan.start))
    for r in range(plan.start, plan.num_rollout):
        if plan.eval_interval and r % plan.eval_interval == 0 and (r > plan.start or not plan.skip_eval_before_train):
            out.append(("eval", r))
        if plan.mode == "fully_async":
            out.append(("consume", r))
        else:
            if plan.mode == "sync" or r == plan.start:
                out.append(("rollout", r))  # one step ahead, rollout r was launched during step r - 1
            out.append(("train_data", r))
            if plan.mode == "one_step" and r + 1 < plan.num_rollout:
                out.append(("rollout", r + 1))  # generates while step r trains
        if plan.offload_rollout:
            out.append(("release", r))
        out.append(("train", r))
        last = r == plan.num_rollout - 1
        if last or (plan.save_interval and (r + 1) % plan.save_interval == 0):
            if plan.save:
                out.append(("save", r))
            if plan.save_hf:
                out.append(("save_hf", r))
        if plan.sync_weights:
            sync_point(r, r + 1 if (r + 1) % plan.update_weights_interval == 0 else None)
    if plan.eval_interval:
        out.append(("eval", plan.num_rollout))
    if plan.mode == "fully_async":
        out.append(("stop_producer", plan.num_rollout))
    return out
