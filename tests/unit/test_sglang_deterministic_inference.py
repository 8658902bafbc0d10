"""`--sglang-enable-deterministic-inference`: SGLang honours a request's `sampling_seed` only under it (recorded
from 0.5.17: tests/fixtures/sglang-0.5.17/sampling_seed_twice.json), so slime hands it to the simulated servers
exactly when the user asks for it (`_sim_argv`; real SGLang gets every `--sglang-*` flag anyway), and the
preflight says, once, what a run on real SGLang without it gives up (resume regenerates with other tokens)."""

from __future__ import annotations

import logging

import pytest

from slime.arguments import build_parser, default_args
from slime.backends.sglang import engine_choice
from slime.backends.sglang.engine_choice import check_rollout_engine
from slime.backends.sglang.server_args import build_server_argv

pytestmark = pytest.mark.cpu

FLAG = "--sglang-enable-deterministic-inference"
NOTE = "SGLang runs without --sglang-enable-deterministic-inference"


def _args(*argv: str, **kw):
    parsed = vars(build_parser().parse_args(list(argv)))
    return default_args(**{**parsed, "hf_checkpoint": "/ckpt/toy", "offload_rollout": False, **kw})


@pytest.mark.parametrize("backend", ["sim", "sglang"])
def test_the_flag_reaches_the_server_exactly_when_given(backend):
    def argv(*flags: str) -> list[str]:
        return build_server_argv(_args(*flags), backend=backend, host="127.0.0.1", port=30000, nccl_port=31000)

    assert "--enable-deterministic-inference" in argv(FLAG)
    assert "--enable-deterministic-inference" not in argv()


@pytest.mark.parametrize(("engine", "flags", "noted"), [("sglang", (), True), ("sglang", (FLAG,), False),
                                                        ("sim", (), False)])  # fmt: skip
def test_preflight_notes_a_real_sglang_run_without_it(monkeypatch, caplog, engine, flags, noted):
    monkeypatch.setattr(engine_choice, "choose_rollout_engine", lambda args: (engine, f"{engine} (stubbed)"))
    monkeypatch.setattr(engine_choice, "_check_release", lambda args: None)  # the release checks: their own tests
    with caplog.at_level(logging.INFO, logger=engine_choice.__name__):
        check_rollout_engine(_args(*flags, rollout_engine="auto"))
    assert (NOTE in caplog.text) is noted
    if noted:  # after the other checks: the engine line comes first
        assert caplog.text.index("rollout engine:") < caplog.text.index(NOTE)
