"""Weight checksums: the trainer side (`slime.backends.megatron.weight_hash`) and the fake engine's
`/weights_checker` (`sim.fake_sglang.checker`) agree with each other and with SGLang 0.5.23's own functions.

SGLang's `tensor_hash` / `overall_checksum` are read from the side venv's source (their modules import
torchvision and friends, which the side venv lacks) and executed here on the same tensors.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import os
from pathlib import Path

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sim.fake_sglang import checker
from slime.backends.megatron import weight_hash

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randn(4, 4, generator=g).t(),  # non-contiguous: hashed in logical (row-major) order
        torch.zeros(0),
    ]


def test_tensor_checksum_is_sha256_prefix_of_the_raw_bytes():
    for t in _tensors():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        expected = hashlib.sha256(raw).hexdigest()[:16]
        assert weight_hash.tensor_checksum(t) == expected == checker.tensor_checksum(t)
    a, b = torch.ones(4), torch.ones(4)
    b[2] = torch.nextafter(b[2], torch.tensor(2.0))  # one ulp apart
    assert weight_hash.tensor_checksum(a) != weight_hash.tensor_checksum(b)
    sums = {"b": "01", "a": "02"}
    assert weight_hash.overall_checksum(sums) == checker.overall_checksum(dict(reversed(sums.items())))


def _sglang_functions() -> dict:
    venv = Path(os.environ.get("SLIME_SGLANG_VENV", ROOT / ".venv-sglang"))
    pkg = next(venv.glob("lib/python3*/site-packages/sglang"), None)
    if pkg is None:
        msg = f"SGLang side venv not found at {venv}; create it with `bash ci/sglang_venv.sh`"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    ns: dict = {"hashlib": hashlib, "torch": torch}
    wanted = {
        pkg / "srt/managers/mm_utils.py": {"tensor_hash"},
        pkg / "srt/utils/weight_checker.py": {"overall_checksum", "_hash_tensor"},
    }
    for path, names in wanted.items():
        tree = ast.parse(path.read_text())
        funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
        assert {f.name for f in funcs} == names, path
        exec(compile(ast.Module(body=funcs, type_ignores=[]), str(path), "exec"), ns)  # noqa: S102
    return ns


def test_matches_sglang_0_5_23_source():
    sg = _sglang_functions()
    sums = {}
    for i, t in enumerate(_tensors()):
        name = f"model.layers.{i}.weight"
        sums[name] = sg["_hash_tensor"](t.contiguous())
        assert weight_hash.tensor_checksum(t) == sums[name]
    assert weight_hash.overall_checksum(sums) == sg["overall_checksum"](sums) == checker.overall_checksum(sums)


class _TinyLM(torch.nn.Module):
    """HF-like names, a tied head (listed once by named_parameters) and a non-persistent RoPE buffer."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 11, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("rotary_inv_freq", torch.arange(2.0), persistent=False)


class _Engine:
    name = "hf"

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.model = model
        self.step_lock = asyncio.Lock()


async def _call(engine: _Engine, *steps) -> list[tuple[int, dict]]:
    """Requests to one app (one checker state); a body of None is a GET, a callable runs between requests."""
    app = web.Application()

    @web.middleware
    async def log_slot(request, handler):  # the real server's logging middleware provides request["log"]
        request["log"] = {}
        return await handler(request)

    app.middlewares.append(log_slot)
    checker.register_weights_checker(app, engine)
    out = []
    async with TestClient(TestServer(app)) as client:
        for step in steps:
            if callable(step):
                step()
                continue
            r = await (client.get("/weights_checker") if step is None else client.post("/weights_checker", json=step))
            out.append((r.status, await r.json()))
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_engine_checksums_equal_trainer_side_hashes(tied):
    torch.manual_seed(0)
    model = _TinyLM(tied)
    (status, got), (status2, got2) = asyncio.run(_call(_Engine(model), None, {"action": "checksum"}))
    assert status == status2 == 200 and got == got2 and got["success"]
    rank = got["ranks"][0]
    names = {"embed.weight", "norm.weight", "norm.bias"} | (set() if tied else {"lm_head.weight"})
    assert set(rank["checksums"]) == names  # tied head listed once; the RoPE buffer is never hashed
    sent = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    mine = weight_hash.hf_weight_checksums(sent)
    assert weight_hash.compare_checksums(mine, rank["checksums"]) == []
    assert rank["per_gpu_checksum"] == weight_hash.overall_checksum(mine)
    assert got["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
    # casting on the trainer side is what the engine would store; a different dtype hashes differently
    assert weight_hash.hf_weight_checksums(sent, dtype=torch.float32) == mine
    assert weight_hash.hf_weight_checksums(sent, dtype=torch.bfloat16) != mine


def test_compare_names_missing_extra_and_differing_tensors():
    trainer = {"a": "1", "b": "2", "c": "3"}
    engine = {"b": "2", "c": "4", "d": "5"}
    problems = weight_hash.compare_checksums(trainer, engine)
    assert problems == ["a: not on the engine", "d: on the engine but never sent", "c: trainer 3 != engine 4"]
    with pytest.raises(ValueError, match="twice"):
        weight_hash.hf_weight_checksums([("x", torch.ones(1)), ("x", torch.ones(1))])


def test_snapshot_reset_compare_and_errors():
    model = _TinyLM(tied=False)
    engine = _Engine(model)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}

    def restore() -> None:  # a "weight update" that rewrites every tensor
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])

    # SGLang's check: snapshot the loaded weights, scramble them, update, compare (the update must rewrite all)
    steps = [{"action": "compare"}, {"action": "snapshot"}, {"action": "reset_tensors"}, {"action": "compare"}]
    steps += [restore, {"action": "compare"}, {"action": "compare"}, {"action": "bogus"}]
    no_snap, snap, reset, broken, ok, consumed, bogus = asyncio.run(_call(engine, *steps))
    assert no_snap[0] == 400 and "snapshot" in no_snap[1]["message"]
    assert snap == reset == ok == (200, {"success": True, "message": "Success."})
    assert consumed[0] == 400  # a successful compare uses the snapshot up
    assert broken[0] == 400 and "equality failed" in broken[1]["message"]
    assert bogus[0] == 400 and "Unsupported" in bogus[1]["message"]
    [(status, body)] = asyncio.run(_call(_Engine(None), {"action": "checksum"}))
    assert status == 400 and not body["success"] and "no weights" in body["message"]


def test_hashing_a_parameter_leaves_its_storage_releasable():
    """The offloader releases a sleeping trainer's params by resizing their storages; a checksum of a live
    parameter (a view in the export) must not hand that storage to numpy, which makes it non-resizable."""
    from slime.backends.megatron.weight_hash import tensor_checksum

    p = torch.nn.Parameter(torch.randn(8, 4))
    before = tensor_checksum(p[:, 1])  # a strided view, as the export yields
    assert p.untyped_storage().resizable()
    p.untyped_storage().resize_(0)  # what offload.py does to release it
    p.untyped_storage().resize_(8 * 4 * 4)
    assert len(before) == 16
