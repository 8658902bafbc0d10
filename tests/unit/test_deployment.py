"""`slime plan` for six topologies (single model, PD, multi-model, mixed engine sizes, a placeholder group first,
colocated with partial offload), against values worked out by hand (arithmetic in comments).

GPU indices are logical placement-group indices; rollout GPUs start after the actor's unless colocated.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from slime.plan_cli import main as plan_main

pytestmark = pytest.mark.cpu

HF = "/ckpt/policy"


def plan(tmp_path, capsys, yaml_text: str | None, *flags: str) -> dict:
    argv = ["--json", "--hf-checkpoint", HF, *flags]
    if yaml_text is not None:
        p = tmp_path / "topo.yaml"
        p.write_text(textwrap.dedent(yaml_text).lstrip("\n"))
        argv += ["--sglang-config", str(p)]
    assert plan_main(argv) == 0
    return json.loads(capsys.readouterr().out)


def rows(p: dict, *keys: str) -> list[tuple]:
    return [tuple(e[k] for k in keys) for e in p["engines"]]


def test_single_model_default(tmp_path, capsys):
    # actor 1x8 GPUs, rollout 4 GPUs at 2/engine, not colocated: offset = 8; 4 / 2 = 2 engines at 8 and 10
    p = plan(tmp_path, capsys, None, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    assert p["rollout_offset"] == 8
    assert rows(p, "model", "worker_type", "gpu_start", "num_gpus", "base_gpu_id") == [
        ("default", "regular", 0, 2, 8), ("default", "regular", 2, 2, 10),
    ]  # fmt: skip
    assert [(r["model"], r["pd"], r["receives_weights"]) for r in p["routers"]] == [("default", False, True)]
    assert all(e["bootstrap_port"] is None and e["disaggregation_mode"] is None for e in p["engines"])


def test_pd(tmp_path, capsys):
    yaml_text = """
    sglang:
      - name: actor
        server_groups:
          - {worker_type: prefill, num_gpus: 4, num_gpus_per_engine: 2}
          - {worker_type: decode, num_gpus: 12, num_gpus_per_engine: 4}
    """
    p = plan(tmp_path, capsys, yaml_text, "--rollout-num-gpus", "16")
    # prefill: 4 / 2 = 2 engines at rollout GPUs 0, 2 -> placement 8, 10; decode: 12 / 4 = 3 at 4, 8, 12 -> 12, 16, 20
    assert rows(p, "worker_type", "gpu_start", "num_gpus", "base_gpu_id", "disaggregation_mode") == [
        ("prefill", 0, 2, 8, "prefill"), ("prefill", 2, 2, 10, "prefill"),
        ("decode", 4, 4, 12, "decode"), ("decode", 8, 4, 16, "decode"), ("decode", 12, 4, 20, "decode"),
    ]  # fmt: skip
    assert [e["bootstrap_port"] is not None for e in p["engines"]] == [True, True, False, False, False]
    assert [(r["model"], r["pd"]) for r in p["routers"]] == [("actor", True)]


def test_multi_model(tmp_path, capsys):
    yaml_text = """
    sglang:
      - {name: actor, update_weights: true, num_gpus_per_engine: 4, server_groups: [{num_gpus: 8}]}
      - {name: ref, model_path: /ckpt/ref, update_weights: false, server_groups: [{num_gpus: 4}]}
      - {name: reward, model_path: /ckpt/rm, update_weights: false, server_groups: [{num_gpus: 4}]}
    """
    p = plan(tmp_path, capsys, yaml_text, "--rollout-num-gpus", "16", "--rollout-num-gpus-per-engine", "4")
    # actor 8 / 4 = 2 engines at 0, 4; ref 4 / 4 = 1 at 8; reward 1 at 12; placement offset 8 on top
    assert rows(p, "model", "gpu_start", "base_gpu_id", "model_path") == [
        ("actor", 0, 8, HF), ("actor", 4, 12, HF), ("ref", 8, 16, "/ckpt/ref"), ("reward", 12, 20, "/ckpt/rm"),
    ]  # fmt: skip
    assert [(r["model"], r["receives_weights"]) for r in p["routers"]] == [
        ("actor", True), ("ref", False), ("reward", False),
    ]  # fmt: skip
    assert len({r["port"] for r in p["routers"]}) == 3  # one router per model


def test_heterogeneous_engine_sizes(tmp_path, capsys):
    yaml_text = """
    sglang:
      - name: default
        server_groups:
          - {num_gpus: 4, num_gpus_per_engine: 2}
          - {num_gpus: 2, num_gpus_per_engine: 1}
          - {worker_type: placeholder, num_gpus: 2}
    """
    p = plan(tmp_path, capsys, yaml_text, "--rollout-num-gpus", "8", "--actor-num-gpus-per-node", "4")
    # TP2 x 2 at 0, 2; TP1 x 2 at 4, 5; placeholder holds 6..7 without engines; offset = 4 actor GPUs
    assert rows(p, "gpu_start", "num_gpus", "base_gpu_id") == [(0, 2, 4), (2, 2, 6), (4, 1, 8), (5, 1, 9)]
    assert [(g["worker_type"], g["gpu_start"], g["num_engines"]) for g in p["groups"]] == [
        ("regular", 0, 2), ("regular", 4, 2), ("placeholder", 6, 0),
    ]  # fmt: skip


def test_placeholder_first(tmp_path, capsys):
    yaml_text = """
    sglang:
      - name: default
        server_groups:
          - {worker_type: placeholder, num_gpus: 2}
          - {num_gpus: 6, num_gpus_per_engine: 3}
    """
    p = plan(tmp_path, capsys, yaml_text, "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "1")
    # the placeholder reserves rollout GPUs 0..1, so the 6 / 3 = 2 engines start at 2 and 5 (placement 10, 13)
    assert rows(p, "gpu_start", "num_gpus", "base_gpu_id") == [(2, 3, 10), (5, 3, 13)]


def test_colocated_mixed_offload(tmp_path, capsys):
    yaml_text = """
    sglang:
      - {name: actor, update_weights: true, server_groups: [{num_gpus: 4}]}
      - {name: ref, model_path: /ckpt/ref, update_weights: false, server_groups: [{num_gpus: 4}]}
    """
    p = plan(tmp_path, capsys, yaml_text, "--colocate", "--rollout-num-gpus-per-engine", "2")
    # colocate: rollout GPUs = actor GPUs = 8, offset 0; both groups start inside [0, 8) -> offloaded, memory saver on
    assert p["rollout_offset"] == 0 and p["rollout_num_gpus"] == 8
    assert rows(p, "model", "base_gpu_id", "needs_offload", "enable_memory_saver") == [
        ("actor", 0, True, True), ("actor", 2, True, True), ("ref", 4, True, True), ("ref", 6, True, True),
    ]  # fmt: skip
    # rollout larger than training (colocate rule at HEAD): the ref group starts at GPU 4, outside the actor's
    # [0, 4), so it is not offloaded and runs without the memory saver
    p = plan(tmp_path, capsys, yaml_text, "--colocate", "--rollout-num-gpus", "8", "--actor-num-gpus-per-node", "4",
             "--rollout-num-gpus-per-engine", "2")  # fmt: skip
    assert [g["needs_offload"] for g in p["groups"]] == [True, False]
    assert rows(p, "model", "enable_memory_saver") == [
        ("actor", True),
        ("actor", True),
        ("ref", False),
        ("ref", False),
    ]


def test_table_output(tmp_path, capsys):
    assert plan_main(["--hf-checkpoint", HF, "--rollout-num-gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "routers (one per model)" in out and "regular" in out and "default" in out
