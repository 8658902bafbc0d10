"""Which inference servers a run starts: never the simulated ones silently on a CUDA machine, SGLang's flags
checked against the release its interpreter imports, all before Ray (slime/backends/sglang/engine_choice.py).

The CUDA probe is stubbed where a test needs a "CUDA machine"; the SGLang interpreter is the CPU side venv
(`.venv-sglang`, SGLang 0.5.23's Python package), which CI installs.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime.arguments import default_args
from slime.backends.sglang import engine_choice
from slime.backends.sglang.engine_choice import check_rollout_engine, choose_rollout_engine, installed_sglang
from slime.utils.errors import SlimeArgError
from tests.side_venv import side_venv_python

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def cuda(monkeypatch):
    """A machine with CUDA, as far as the engine choice can tell."""
    monkeypatch.setattr(engine_choice, "cuda_available", lambda: True)


@pytest.fixture()
def model(tmp_path) -> str:
    cfg = {"model_type": "qwen2", "vocab_size": 64, "num_hidden_layers": 1, "hidden_size": 16,
           "intermediate_size": 32, "num_attention_heads": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # preflight reads the architecture
    return str(tmp_path)


def test_auto_picks_the_simulated_servers_only_without_cuda(monkeypatch, caplog):
    monkeypatch.setattr(engine_choice, "cuda_available", lambda: False)
    args = default_args(rollout_engine="auto", rollout_num_gpus=1)
    with caplog.at_level(logging.INFO, logger=engine_choice.__name__):
        check_rollout_engine(args)
    assert args.rollout_engine == "sim" and "rollout engine: sim servers" in caplog.text
    assert "this machine has no CUDA" in caplog.text


def test_auto_on_a_cuda_machine_without_sglang_is_refused_naming_the_way_to_ask_for_the_fake(cuda):
    assert installed_sglang(sys.executable) is None  # slime's own venv never holds SGLang
    with pytest.raises(SlimeArgError, match=r"has CUDA but SGLang is not importable.*--rollout-engine sim"):
        choose_rollout_engine(default_args(rollout_engine="auto"))
    with pytest.raises(SlimeArgError, match="--rollout-engine sglang: SGLang is not importable"):
        choose_rollout_engine(default_args(rollout_engine="sglang"))


def test_auto_on_a_cuda_machine_with_sglang_picks_it_and_says_which(cuda):
    py = side_venv_python()
    engine, why = choose_rollout_engine(default_args(rollout_engine="auto", sglang_python=py))
    assert engine == "sglang" and why.startswith(f"SGLang 0.5.23 from --sglang-python {py}"), why


def test_preflight_checks_flags_against_the_installed_release_and_its_own_parser(cuda, model, caplog):
    py = side_venv_python()
    base = dict(rollout_engine="auto", sglang_python=py, hf_checkpoint=model, rollout_num_gpus=1)
    args = default_args(**base)
    with caplog.at_level(logging.INFO):
        check_rollout_engine(args)
    assert args.rollout_engine == "sglang"  # written back: every engine actor starts what was checked
    assert "accepted by SGLang 0.5.23's own parser" in caplog.text and "rollout engine: SGLang 0.5.23" in caplog.text
    # a flag of the 0.5.17 snapshot only: parsed (slime accepts every committed release's flags), refused here
    args = default_args(**base, sglang_torchao_config="int8wo")
    with pytest.raises(
        SlimeArgError, match=r"--sglang-torchao-config is not a server flag of SGLang 0\.5\.23.*0\.5\.17"
    ):
        check_rollout_engine(args)
    # a value only SGLang's own validator knows is wrong (the snapshot records this option as a plain string)
    args = default_args(**base, sglang_cuda_graph_backend_decode="bogus")
    with pytest.raises(SlimeArgError, match=r"SGLang 0\.5\.23 refuses the server flags of model .* group:"):
        check_rollout_engine(args)


def test_slime_train_on_a_cuda_machine_without_sglang_stops_in_one_line_before_ray(tmp_path, model):
    """The whole CLI, CUDA stubbed in its process: one line naming --rollout-engine sim, exit 2, no Ray."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"input": "a", "label": "1"}\n')
    ray_tmp = tmp_path / "ray_tmp"
    ray_tmp.mkdir()
    argv = ["train", "--hf-checkpoint", model, "--prompt-data", str(data), "--num-rollout", "1",
            "--rollout-num-gpus", "1", "--rollout-batch-size", "1", "--metrics-dir", str(tmp_path / "m")]  # fmt: skip
    code = (
        "import sys, slime.utils.cuda as c; c.cuda_available = lambda: True\n"
        f"from slime.cli import main; sys.exit(main({argv!r}))"
    )
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "SLIME_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "SGLang is not importable" in lines[0] and "--rollout-engine sim" in lines[0]
    assert "Traceback" not in proc.stderr and not os.listdir(ray_tmp)
