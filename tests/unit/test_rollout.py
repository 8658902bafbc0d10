"""The default rollout function against a small in-test `/generate` stub.

The stub speaks the SGLang 0.5.23 answer shape (the version slime pins) and acts as its own router (`GET /workers`
lists itself), so the loop, abort, partial-rollout recycling and seeds are tested without extra processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from slime.arguments import default_args
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.generate import ROUTING_KEY_HEADER, derive_sampling_seed, generate
from slime.rollout.sglang_rollout import generate_rollout, get_model_url
from slime.utils.async_utils import run
from slime.utils.types import Sample, Status

pytestmark = pytest.mark.cpu

MAX_NEW = 4


class StubEngine:
    """`/generate` that samples from (sampling_seed, input length); prompts containing SLOW hang until aborted."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.requests: list[dict[str, Any]] = []
        self.aborts: list[dict[str, Any]] = []
        self.hold_slow = True
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        self.released = asyncio.Event()
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/workers", self._workers)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"body": body, "headers": dict(request.headers)})
        ids, sp = body["input_ids"], body["sampling_params"]
        n = min(sp["max_new_tokens"], MAX_NEW)
        rng = random.Random(f"{sp.get('sampling_seed')}:{len(ids)}:{sp['temperature']}")
        out = [rng.randrange(10, 100) for _ in range(n)]
        finish: dict[str, Any] = (
            {"type": "length", "length": n} if n == sp["max_new_tokens"] else {"type": "stop", "matched": out[-1]}
        )
        if self.hold_slow and "SLOW" in self.tok.decode(ids):
            await self.released.wait()
            out, finish = out[:1], {"type": "abort", "message": "Abort all requests"}
        meta = {
            "finish_reason": finish,
            "output_token_logprobs": [[-0.25, t, None] for t in out],
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "weight_version": "7",
        }
        return web.json_response({"text": "".join(f"<{t}>" for t in out), "output_ids": out, "meta_info": meta})

    async def _abort(self, request: web.Request) -> web.Response:
        self.aborts.append(await request.json())
        self.released.set()
        return web.json_response({})

    async def _workers(self, request: web.Request) -> web.Response:
        # sglang-router 0.3.2's shape, checked against a live `python -m sglang_router.launch_router`
        return web.json_response({"workers": [{"id": "w0", "url": self.url, "worker_type": "regular"}], "total": 1})

    def generate_bodies(self) -> list[dict[str, Any]]:
        return [r["body"] for r in self.requests]

    def close(self) -> None:
        async def stop() -> None:
            self.released.set()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture
def engine(tiny_ckpt: Path):
    from transformers import AutoTokenizer

    stub = StubEngine(AutoTokenizer.from_pretrained(tiny_ckpt))
    try:
        yield stub
    finally:
        stub.close()


# prompt -> per-trajectory rewards: q0 and q4 have zero std (dropped by the filter), q2 hangs until aborted
PROMPTS = [
    ("q0", [1, 1]),
    ("q1", [0, 1]),
    ("q2 SLOW", [0, 1]),
    ("q3", [1, 0]),
    ("q4", [0, 0]),
    ("q5", [1, 0]),
]


def table_rm(args: Any, sample: Sample) -> float:
    rewards = sample.metadata.get("rewards")
    if rewards is None:
        return float(sample.response_length == MAX_NEW)
    return float(rewards[sample.index % args.n_samples_per_prompt])


async def group_rm(args: Any, samples: list[Sample]) -> list[float]:
    return [float(i) for i in range(len(samples))]


async def fan_out_generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample]:
    sample = await generate(args, sample, sampling_params)
    second = Sample.from_dict(sample.to_dict())
    second.response += " (segment 2)"
    sample.group_id = second.group_id = 1000 + sample.index
    return [sample, second]


def rollout_args(tmp_path: Path, tiny_ckpt: Path, engine: StubEngine, **kw: Any) -> argparse.Namespace:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": p, "metadata": {"rewards": r}}) + "\n" for p, r in PROMPTS))
    base = dict(
        prompt_data=str(data),
        hf_checkpoint=str(tiny_ckpt),
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        over_sampling_batch_size=2,  # what validation derives from --rollout-batch-size
        sglang_router_ip="127.0.0.1",
        sglang_router_port=engine.port,
        sglang_server_concurrency=16,
        rollout_num_gpus=1,
        rollout_max_response_len=MAX_NEW,
        custom_rm_path=f"{__name__}.table_rm",
        dynamic_sampling_filter_path="slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
    )
    base.update(kw)
    return default_args(**base)


def group_prompts(groups: list[list[Any]]) -> list[str]:
    return [(g[0][0] if isinstance(g[0], list) else g[0]).prompt for g in groups]


def test_over_sampling_filter_and_abort(tmp_path: Path, tiny_ckpt: Path, engine: StubEngine) -> None:
    args = rollout_args(tmp_path, tiny_ckpt, engine)
    ds = RolloutDataSourceWithBuffer(args)
    out = generate_rollout(args, 0, ds)
    assert isinstance(out, RolloutFnTrainOutput)
    assert group_prompts(out.samples) == ["q1", "q3"]  # accepted == rollout_batch_size, sorted by index
    assert out.metrics["rollout/dynamic_filter/drop_zero_std_1.0"] == 1
    assert out.metrics["rollout/num_groups"] == 2 and out.metrics["rollout/num_samples"] == 4
    assert out.metrics["rollout/reward_mean"] == 0.5 and out.metrics["rollout/response_len_mean"] == MAX_NEW
    assert out.metrics["rollout/truncated_ratio"] == 1.0
    assert engine.aborts == [{"abort_all": True}]
    assert ds.offset == 4 and ds.buffer == []  # q2 was aborted and discarded (no partial rollout)
    for g in out.samples:
        for s in g:
            assert s.status == Status.TRUNCATED and s.response_length == MAX_NEW == len(s.rollout_log_probs)
            assert s.tokens[-MAX_NEW:] and s.weight_versions == ["7"] and s.reward in (0.0, 1.0)
    headers = {r["body"]["input_ids"][0]: r["headers"] for r in engine.requests}
    assert all(ROUTING_KEY_HEADER in h for h in headers.values())
    body = engine.generate_bodies()[0]
    assert body["return_logprob"] is True and body["sampling_params"]["no_stop_trim"] is True
    assert body["sampling_params"]["spaces_between_special_tokens"] is False


def test_partial_rollout_recycles_and_continues_with_remaining_budget(
    tmp_path: Path, tiny_ckpt: Path, engine: StubEngine
) -> None:
    args = rollout_args(tmp_path, tiny_ckpt, engine, partial_rollout=True, mask_offpolicy_in_partial_rollout=True)
    ds = RolloutDataSourceWithBuffer(args)
    generate_rollout(args, 0, ds)
    assert len(ds.buffer) == 1
    slow = ds.buffer[0]
    assert all(s.status == Status.ABORTED and s.response_length == 1 for s in slow)
    assert all(s.metadata["start_rollout_id"] == 0 and s.reward is None for s in slow)

    slow_len = len(slow[0].tokens)  # prompt + the one token produced before the abort
    engine.hold_slow = False
    n_before = len(engine.requests)
    out = generate_rollout(args, 1, ds)
    resumed = [g for g in out.samples if g[0].prompt == "q2 SLOW"]
    assert len(resumed) == 1
    for s in resumed[0]:
        assert s.response_length == MAX_NEW and s.loss_mask == [0, 1, 1, 1] and len(s.rollout_log_probs) == MAX_NEW
        assert s.status == Status.TRUNCATED and s.reward is not None
    continued = [b for b in engine.generate_bodies()[n_before:] if len(b["input_ids"]) == slow_len]
    assert continued and all(b["sampling_params"]["max_new_tokens"] == MAX_NEW - 1 for b in continued)


def test_sampling_seed_determinism(tmp_path: Path, tiny_ckpt: Path, engine: StubEngine) -> None:
    def once(rollout_id: int) -> list[list[int]]:
        args = rollout_args(tmp_path, tiny_ckpt, engine, dynamic_sampling_filter_path=None)
        out = generate_rollout(args, rollout_id, RolloutDataSourceWithBuffer(args))
        for g in out.samples:
            for s in g:
                assert s.metadata["sampling_seed"] == derive_sampling_seed(42, rollout_id, s.index)
        return [s.tokens for g in out.samples for s in g]

    a, b, c = once(5), once(5), once(6)
    assert a == b and a != c
    assert a[0] != a[1]  # the two trajectories of a prompt got different seeds
    seeds = [body["sampling_params"]["sampling_seed"] for body in engine.generate_bodies()]
    assert len(set(seeds[:4])) == 4


def test_continuation_budget_and_zero_budget(tmp_path: Path, tiny_ckpt: Path, engine: StubEngine) -> None:
    args = rollout_args(tmp_path, tiny_ckpt, engine)
    params = {"max_new_tokens": 5, "temperature": 1.0}
    s = Sample(index=0, tokens=[1, 2, 3, 4], response="abc", response_length=3, loss_mask=[1, 1, 1])
    s = run(generate(args, s, params))
    assert engine.generate_bodies()[-1]["sampling_params"]["max_new_tokens"] == 2
    assert s.response_length == 5 and s.tokens[:4] == [1, 2, 3, 4] and len(s.tokens) == 6 and s.loss_mask == [1] * 5
    assert s.status == Status.TRUNCATED and params["max_new_tokens"] == 5  # caller's params untouched

    done = Sample(index=1, tokens=[1, 2, 9, 9, 9, 9, 9], response_length=5)
    n = len(engine.requests)
    done = run(generate(args, done, params))
    assert done.status == Status.TRUNCATED and len(engine.requests) == n  # no call with a zero budget


def test_custom_generate_fan_out_and_group_rm(tmp_path: Path, tiny_ckpt: Path, engine: StubEngine) -> None:
    args = rollout_args(
        tmp_path,
        tiny_ckpt,
        engine,
        custom_generate_function_path=f"{__name__}.fan_out_generate",
        dynamic_sampling_filter_path=None,
    )
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(out.samples) == 2
    for g in out.samples:
        assert len(g) == 2 and all(isinstance(traj, list) and len(traj) == 2 for traj in g)
        for traj in g:
            assert traj[0].group_id == traj[1].group_id == 1000 + traj[0].index
            expected = float(traj[0].metadata["rewards"][traj[0].index % 2])
            assert [s.reward for s in traj] == [expected, expected]  # every segment scored (batched rm)

    args_g = rollout_args(tmp_path, tiny_ckpt, engine, group_rm=True, custom_rm_path=f"{__name__}.group_rm")
    args_g.dynamic_sampling_filter_path = None
    out = generate_rollout(args_g, 0, RolloutDataSourceWithBuffer(args_g))
    assert [[s.reward for s in g] for g in out.samples] == [[0.0, 1.0], [0.0, 1.0]]


def test_eval_output(tmp_path: Path, tiny_ckpt: Path, engine: StubEngine) -> None:
    evalf = tmp_path / "eval.jsonl"
    evalf.write_text("".join(json.dumps({"input": f"e{i}"}) + "\n" for i in range(2)))
    args = rollout_args(
        tmp_path,
        tiny_ckpt,
        engine,
        eval_prompt_data=["toy", str(evalf)],
        n_samples_per_eval_prompt=3,
        eval_temperature=0.5,
    )
    out = call_rollout_fn(generate_rollout, args, 3, None, evaluation=True)
    assert isinstance(out, RolloutFnEvalOutput) and set(out.data) == {"toy"}
    toy = out.data["toy"]
    assert len(toy["samples"]) == len(toy["rewards"]) == len(toy["truncated"]) == 6
    assert [s.index for s in toy["samples"]] == list(range(6))
    assert [s.prompt for s in toy["samples"]] == ["e0"] * 3 + ["e1"] * 3
    assert toy["rewards"] == [1.0] * 6 and toy["truncated"] == [True] * 6 and out.metrics["eval/toy"] == 1.0
    assert all(b["sampling_params"]["temperature"] == 0.5 for b in engine.generate_bodies())


def test_group_rm_scores_each_eval_prompt_as_a_group(tmp_path: Path, tiny_ckpt: Path, engine: StubEngine) -> None:
    evalf = tmp_path / "eval.jsonl"
    evalf.write_text("".join(json.dumps({"input": f"e{i}"}) + "\n" for i in range(2)))
    args = rollout_args(
        tmp_path, tiny_ckpt, engine, eval_prompt_data=["toy", str(evalf)], n_samples_per_eval_prompt=3,
        group_rm=True, custom_rm_path=f"{__name__}.group_rm",
    )  # fmt: skip
    toy = call_rollout_fn(generate_rollout, args, 0, None, evaluation=True).data["toy"]
    # group_rm scores a list: position in the group, so one call per prompt gives 0, 1, 2 twice
    assert [s.prompt for s in toy["samples"]] == ["e0"] * 3 + ["e1"] * 3
    assert toy["rewards"] == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]


def test_eval_fixed_sampling_seed(tmp_path: Path, tiny_ckpt: Path, engine: StubEngine) -> None:
    """Evals at different rollouts share seeds only with --eval-fixed-sampling-seed (common random numbers)."""
    evalf = tmp_path / "eval.jsonl"
    evalf.write_text("".join(json.dumps({"input": f"e{i}"}) + "\n" for i in range(2)))

    def seeds(fixed: bool, rollout_id: int) -> list[int]:
        args = rollout_args(
            tmp_path, tiny_ckpt, engine, eval_prompt_data=["toy", str(evalf)], n_samples_per_eval_prompt=2
        )
        args.eval_fixed_sampling_seed = fixed
        out = call_rollout_fn(generate_rollout, args, rollout_id, None, evaluation=True)
        return [s.metadata["sampling_seed"] for s in out.data["toy"]["samples"]]

    fixed = [seeds(True, r) for r in (0, 5, 10)]
    assert fixed[0] == fixed[1] == fixed[2] and len(set(fixed[0])) == 4
    assert fixed[0] == [derive_sampling_seed(42, 0, i) for i in range(4)]
    fresh = [seeds(False, r) for r in (0, 5)]
    assert fresh[0] == fixed[0] and set(fresh[1]).isdisjoint(fresh[0])
    sent = [b["sampling_params"].get("sampling_seed") for b in engine.generate_bodies()]
    assert sent[-4:] == fresh[1]  # the seed recorded on the sample is the one the engine received


def test_get_model_url_and_legacy_returns(make_args: Callable[..., Any]) -> None:
    args = make_args(
        sglang_router_ip="127.0.0.1", sglang_router_port=3000, sglang_model_routers={"ref": "http://10.0.0.2:4000"}
    )
    assert get_model_url(args) == "http://127.0.0.1:3000/generate"
    assert get_model_url(args, "ref", "/abort_request") == "http://10.0.0.2:4000/abort_request"
    with pytest.raises(KeyError, match=r"'judge'.*known models: \['ref'\]"):
        get_model_url(args, "judge")

    legacy = call_rollout_fn(lambda a, r, d, evaluation: [[Sample()]], args, 0, None, evaluation=False)
    assert isinstance(legacy, RolloutFnTrainOutput) and legacy.metrics is None and len(legacy.samples) == 1
    legacy_eval = call_rollout_fn(lambda a, r, d, evaluation: {"x": {}}, args, 0, None, evaluation=True)
    assert isinstance(legacy_eval, RolloutFnEvalOutput) and legacy_eval.data == {"x": {}}
