"""The pieces of async training one by one: the flags' one-line refusals, the staleness rule, the buffer, the
producer's checkpoint glue on the RolloutManager side, and partial-rollout masking under --fully-async."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from slime.arguments import default_args, parse_args
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.scheduling.group_buffer import GroupBuffer, group_from_json, group_to_json
from slime.scheduling.staleness import (
    DISPATCH_VERSION_KEY,
    group_min_version,
    group_staleness,
    mark_context_only,
    reset_for_retry,
    sample_min_version,
)
from slime.utils.errors import SlimeArgError
from slime.utils.types import Sample, Status

pytestmark = pytest.mark.cpu


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    (tmp_path / "config.json").write_text("{}")
    return ["--hf-checkpoint", str(tmp_path), "--rollout-batch-size", "4", "--num-rollout", "2",
            "--rollout-num-gpus", "1", "--n-samples-per-prompt", "2"]  # fmt: skip


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--fully-async", "--one-step-ahead"], "pick one"),
        (["--fully-async", "--colocate"], "drop --colocate"),
        (["--one-step-ahead", "--colocate"], "drop --colocate"),
        (["--fully-async", "--debug-rollout-only"], "debug modes"),
        (["--one-step-ahead", "--offload-rollout"], "release the engines' memory"),
        (["--fully-async", "--rollout-function-path", "x.y"], "custom --rollout-function-path"),
        (["--fully-async", "--partial-rollout"], "drop --partial-rollout"),
        (["--fully-async", "--over-sampling-batch-size", "8"], "over-sampling"),
        (["--fully-async", "--rollout-all-samples-process-path", "x.y"], "rollout-sample-filter-path"),
        (["--fully-async", "--async-max-concurrent-samples", "1"], "less than one group"),
        (["--fully-async", "--async-data-buffer-capacity-factor", "0.1"], ">= 1 group"),
        (["--async-max-concurrent-samples", "8"], "only applies with --fully-async"),
        (["--custom-async-data-buffer-path", "x.y"], "only applies with --fully-async"),
        (["--max-weight-staleness", "-1"], ">= 0"),
        (["--one-step-ahead", "--max-weight-staleness", "0"], "below the staleness every batch has"),
        (["--fully-async", "--update-weights-interval", "3", "--max-weight-staleness", "1"], "raise it to >= 2"),
    ],
)
def test_impossible_combinations_are_one_line_errors(base, extra, message):
    with pytest.raises(SlimeArgError, match=message) as e:
        parse_args([*base, *extra])
    assert "\n" not in str(e.value)


def test_valid_async_flags_parse(base):
    args = parse_args([*base, "--fully-async", "--max-weight-staleness", "2", "--async-unused-samples-handler",
                       "drop", "--async-max-concurrent-samples", "6", "--mask-offpolicy-in-partial-rollout"])  # fmt: skip
    assert args.fully_async and args.max_weight_staleness == 2 and args.async_unused_samples_handler == "drop"
    assert parse_args([*base, "--one-step-ahead", "--max-weight-staleness", "1"]).one_step_ahead


@pytest.mark.parametrize("schedule", ["--one-step-ahead", "--fully-async"])
def test_ppo_and_role_overrides_parse_under_both_async_schedules(base, tmp_path, schedule):
    roles = tmp_path / "roles.yaml"
    roles.write_text("megatron:\n  - {role: critic, overrides: {lr: 1.0e-5}}\n")
    args = parse_args([*base, schedule, "--advantage-estimator", "ppo", "--megatron-config", str(roles)])
    assert args.role_overrides["critic"] == {"lr": 1e-5}
    assert args.offload_train  # actor and critic still time-share their GPUs


def _answered(s: Sample, version: int, n: int) -> Sample:
    s.update_from_meta_info(default_args(), {"weight_version": str(version), "completion_tokens": n})
    s.response_length += n
    s.tokens += [7] * n
    return s


def test_staleness_counts_the_oldest_trained_token():
    s = _answered(_answered(Sample(index=0, group_index=0, tokens=[1, 2]), 3, 4), 5, 2)
    assert s.weight_version_spans == [["3", 4, True], ["5", 2, True]] and s.weight_versions == ["3", "5"]
    assert sample_min_version(s) == 3 and group_staleness([s], trainer_version=6) == 3
    mark_context_only(s)  # --mask-offpolicy-in-partial-rollout on resume: the old tokens become context
    assert s.loss_mask == [0] * 6 and sample_min_version(s) is None and group_staleness([s], 6) == 0
    _answered(s, 6, 3)
    assert sample_min_version(s) == 6
    # an answer of no token does not make a sample older
    assert sample_min_version(_answered(_answered(Sample(), 2, 0), 4, 1)) == 4


def test_staleness_fallbacks_and_fan_out():
    assert sample_min_version(Sample(weight_versions=["default", "7", "5"])) == 5  # no spans: per-answer versions
    assert sample_min_version(Sample(metadata={DISPATCH_VERSION_KEY: 2})) == 2  # nothing else: dispatch version
    assert sample_min_version(Sample()) is None and group_staleness([Sample()], 9) == 0
    a, b = _answered(Sample(), 4, 1), _answered(Sample(), 2, 1)
    assert group_min_version([[a, b], _answered(Sample(), 6, 1)]) == 2  # a fan-out trajectory counts all segments


def test_reset_for_retry_returns_the_prompt():
    s = _answered(Sample(index=3, group_index=1, tokens=[1, 2, 3], metadata={"sampling_seed": 9}), 1, 4)
    s.reward, s.status, s.loss_mask, s.rollout_log_probs = 1.0, Status.COMPLETED, [1] * 4, [-0.1] * 4
    s.metadata[DISPATCH_VERSION_KEY] = 1
    seg = _answered(Sample(index=4, group_index=1, tokens=[1, 2, 3], group_id=4, metadata={"segment_idx": 0}), 1, 2)
    seg2 = Sample(index=4, group_index=1, tokens=[1, 2, 3, 7, 7, 8], group_id=4, response_length=3)
    (a, b) = reset_for_retry([s, [seg, seg2]])
    assert a.tokens == [1, 2, 3] and a.response_length == 0 and a.reward is None and a.status == Status.PENDING
    assert a.loss_mask is None and a.rollout_log_probs is None and a.weight_version_spans == []
    assert a.metadata == {"sampling_seed": 9}  # the seed stays: a resumed run draws what this one draws
    assert b is seg and b.tokens == [1, 2, 3] and b.group_id is None and "segment_idx" not in b.metadata


def test_group_buffer_is_bounded_fifo_and_round_trips():
    buf = GroupBuffer(default_args(), capacity=2)
    g1, g2 = [Sample(group_index=1)], [[Sample(group_index=2), Sample(group_index=2)]]
    buf.put(g1)
    buf.put(g2)
    with pytest.raises(RuntimeError, match="full"):
        buf.put([Sample(group_index=3)])
    assert [group_from_json(group_to_json(g)) for g in buf] == [g1, g2]
    assert buf.pop(5) == [g1, g2] and len(buf) == 0
    with pytest.raises(ValueError):
        GroupBuffer(default_args(), capacity=0)


def _args(tmp_path: Path, **kw):
    return default_args(rollout_batch_size=2, n_samples_per_prompt=2, disable_rollout_global_dataset=True,
                        fully_async=True, async_max_concurrent_samples=4, **kw)  # fmt: skip


def test_manager_side_checkpoint_round_trip_and_custom_buffer(tmp_path):
    """`FullyAsyncRollout` on the background loop: a custom buffer class, and save/load of the data source with
    the buffer, in-flight groups and prompt bookkeeping (no engines: nothing is started)."""
    from slime.rollout.fully_async import FullyAsyncRollout, state_path

    args = _args(tmp_path, custom_async_data_buffer_path="sim.scheduling.buffers.NewestFirstBuffer")
    source = RolloutDataSourceWithBuffer(args)
    fa = FullyAsyncRollout(args, source)
    assert type(fa.rollout.buffer).__name__ == "NewestFirstBuffer" and fa.rollout.buffer.capacity == 4
    done = source.get_samples(3)  # prompts 0, 1, 2 handed out
    fa.rollout.buffer.put(done[2])
    fa.rollout.consumed_ids = [0]
    fa.rollout.dropped_ids = [1]
    fa.save(5, str(tmp_path))
    assert os.path.exists(state_path(str(tmp_path), 5))

    source2 = RolloutDataSourceWithBuffer(args)
    fa2 = FullyAsyncRollout(args, source2)
    source2.load(5, str(tmp_path))
    fa2.load(5, str(tmp_path))
    assert [g[0].group_index for g in fa2.rollout.buffer] == [2]
    assert fa2.rollout.consumed_ids == [0] and fa2.rollout.dropped_ids == [1]
    assert source2.get_samples(1)[0][0].group_index == 3  # the data source continues where it stood


async def _masked_generate(args, sample, sampling_params):
    sample.update_from_meta_info(
        args, {"weight_version": "2", "completion_tokens": 1, "finish_reason": {"type": "stop"}}
    )
    sample.response_length += 1
    sample.tokens = sample.tokens + [5]
    sample.loss_mask = (sample.loss_mask or []) + [1]
    return sample


def test_mask_offpolicy_applies_under_fully_async(tmp_path):
    from slime.rollout.generate import generate_and_rm

    args = _args(tmp_path, mask_offpolicy_in_partial_rollout=True, rm_type="random",
                 custom_generate_function_path=f"{__name__}._masked_generate")  # fmt: skip
    s = _answered(Sample(index=0, group_index=0, tokens=[1]), 1, 2)
    s.status = Status.ABORTED
    out = asyncio.run(generate_and_rm(args, s, {"max_new_tokens": 8}))
    assert out.loss_mask == [0, 0, 1]
    assert out.weight_version_spans == [["1", 2, False], ["2", 1, True]] and sample_min_version(out) == 2


class _FanOutGenerator:
    """Each trajectory comes back as two segments sharing a group id (a compacted agent trajectory)."""

    def __init__(self) -> None:
        self.version = 0

    async def run_group(self, group):
        await asyncio.sleep(1.0)
        out = []
        for s in group:
            _answered(s, self.version, 2)
            s.status, s.group_id = Status.COMPLETED, 1000 + s.index
            tail = Sample(index=s.index, group_index=s.group_index, group_id=s.group_id, tokens=[1, 9],
                          response_length=1, status=Status.COMPLETED, weight_version_spans=[[str(self.version), 1, True]])  # fmt: skip
            out.append([s, tail])
        return out

    async def abort_all(self) -> None:
        pass

    def allow(self) -> None:
        pass


def test_fully_async_carries_fan_out_groups_to_train_data(tmp_path):
    from sim.scheduling.clock import run_virtual
    from slime.ray.train_data import rollout_samples
    from slime.scheduling.fully_async import AsyncConfig, AsyncRollout

    args = _args(tmp_path)
    source = RolloutDataSourceWithBuffer(args)
    gen = _FanOutGenerator()

    async def main():
        r = AsyncRollout(AsyncConfig(batch_size=2, max_in_flight_groups=2, max_staleness=1), source,
                         GroupBuffer(args, 4), gen, engine_version=0)  # fmt: skip
        r.start(0)
        batches = []
        for step in range(3):
            groups, metrics = await r.consume(step)
            batches.append((groups, metrics))
            await r.pause()
            gen.version = step + 1
            r.resume(step + 1)
        await r.stop()
        return batches

    for groups, metrics in run_virtual(main()):
        assert len(groups) == 2 and all(len(g) == 2 and all(len(t) == 2 for t in g) for g in groups)
        samples = rollout_samples(groups)  # the fan-out contract holds: siblings share one group id
        assert len(samples) == 8 and metrics["async/staleness_max"] <= 1


class _SlowAbortGenerator:
    """Requests run until aborted; the abort takes a while to send, and they come back before it returns."""

    def __init__(self) -> None:
        self.stop = None

    async def run_group(self, group):
        await self.stop.wait()
        for s in group:
            s.status = Status.ABORTED
        return group

    async def abort_all(self) -> None:
        self.stop.set()
        await asyncio.sleep(0.5)

    def allow(self) -> None:
        self.stop.clear()


def test_pause_when_every_request_returns_during_the_abort(tmp_path):
    from sim.scheduling.clock import run_virtual
    from slime.scheduling.fully_async import AsyncConfig, AsyncRollout

    args = _args(tmp_path)
    source = RolloutDataSourceWithBuffer(args)
    gen = _SlowAbortGenerator()

    async def main():
        gen.stop = asyncio.Event()
        r = AsyncRollout(AsyncConfig(batch_size=2, max_in_flight_groups=2), source, GroupBuffer(args, 4), gen)
        r.start(0)
        await asyncio.sleep(1.0)
        assert r.in_flight_groups == 2
        await r.pause()
        assert r.in_flight_groups == 0 and len(source.buffer) == 2  # back in the data source, to resume
        await r.stop()

    run_virtual(main())
