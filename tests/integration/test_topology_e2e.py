"""Acceptance of the multi-model example (examples/sglang_config): `slime train` for 3 rollouts with an actor
served prefill/decode-disaggregated (1 prefill + 2 decode), a frozen `ref` model that scores every response (the
reference of the KL loss via --ref-model-name, and the OPD teacher via --opd-teacher-models) and a 2-engine
generative reward model asked through `/v1/chat/completions`, each behind its own real sglang-router. Every
model must receive requests (read from the fake engines' request logs). Then `--debug-train-only` replays the
dumped rollouts, served log-probs included, with no engine or router at all.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import pytest

from examples.toy.prepare import prepare
from sim.process_tree import ProcessTreeWatcher
from sim.slime_run import slime_train

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

CPU_SHIM = "sim.fake_megatron.cpu_shim.apply"
ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples" / "sglang_config"
BATCH, N_SAMPLES, ROLLOUTS = 4, 2, 3


def run_slime(argv: list[str], out: Path, timeout: float = 900) -> tuple[dict, ProcessTreeWatcher]:
    log_path = out.parent / f"{out.name}.log"
    with slime_train([*argv, "--metrics-dir", str(out)], log_path, {**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
        tree = ProcessTreeWatcher(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            tree.stop()
    assert rc == 0, log_path.read_text()[-6000:]
    return json.loads((out / "summary.json").read_text()), tree


def read_logs(log_dir: Path) -> dict[int, list[dict]]:
    return {
        int(f.stem.split("_")[1]): [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        for f in log_dir.glob("engine_*.jsonl")
    }


def test_example_topology_trains_with_all_three_models(tmp_path):
    assets = tmp_path / "assets"
    prepare(assets, num_train=16, num_eval=2)  # in-process: ~0.02 s, not a ~6 CPU-s interpreter
    dump = tmp_path / "dump" / "rollout_{rollout_id}.pt"
    logs = tmp_path / "engine_logs"
    logs.mkdir()
    base = [
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N_SAMPLES), "--num-rollout", str(ROLLOUTS),
        "--global-batch-size", str(BATCH * N_SAMPLES), "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-max-response-len", "12", "--hf-checkpoint", str(assets / "model"),
        "--custom-megatron-init-path", CPU_SHIM, "--lr", "1e-4",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "k3", "--ref-model-name", "ref",
        "--use-opd", "--opd-type", "sglang", "--opd-teacher-models", "ref", "--opd-kl-coef", "0.1",
    ]  # fmt: skip
    rollout = [
        "--prompt-data", str(assets / "data" / "train.jsonl"), "--input-key", "input", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "reward_model_chat", "--rm-model-name", "reward",
        "--metadata-key", "judge_metadata",  # the toy rows' metadata.rm_type (math) would win over --rm-type
        "--sglang-config", str(EX / "sglang_config.yaml"), "--rollout-num-gpus", "6", "--rollout-engine", "sim",
        "--sim-engine", "hf", "--sim-request-log-dir", str(logs),
    ]  # fmt: skip
    summary, tree = run_slime([*base, *rollout, "--save-debug-rollout-data", str(dump)], tmp_path / "train")

    info = summary["server_info"]
    assert sorted(info["routers"]) == ["actor", "ref", "reward"] and info["routers"]["actor"]["pd"] is True
    assert [(e["model"], e["worker_type"]) for e in info["engines"]] == [
        ("actor", "prefill"), ("actor", "decode"), ("actor", "decode"), ("ref", "regular"),
        ("reward", "regular"), ("reward", "regular"),
    ]  # fmt: skip
    assert tree.count("sglang::router") == 3
    # six engine servers, told apart by their ports: a pid count also sees an engine restarted on a loaded
    # machine, or a forked child orphaned as its engine stops
    ports = {m.group(1) for c in tree.cmdlines.values() if (m := re.search(r"sim\.fake_sglang .*--port (\d+)", c))}
    assert len(ports) == 6, sorted(ports)

    by_rank = read_logs(logs)
    model_of = {e["rank"]: e["model"] for e in info["engines"]}
    kind_of = {e["rank"]: e["worker_type"] for e in info["engines"]}
    per_model = {m: [x for r, xs in by_rank.items() if model_of[r] == m for x in xs] for m in set(model_of.values())}
    total = BATCH * N_SAMPLES * ROLLOUTS
    # actor: every trajectory decoded once, each paired with one prefill; weights synced to its engines only
    decode = [x for r, xs in by_rank.items() if kind_of[r] == "decode" for x in xs if x["endpoint"] == "/generate"]
    assert len(decode) == total and all(x["status"] == 200 for x in decode)
    rooms = Counter(x["bootstrap_room"] for r, xs in by_rank.items() if kind_of[r] == "prefill" for x in xs
                    if x["endpoint"] == "/generate")  # fmt: skip
    assert all(rooms[x["bootstrap_room"]] == 1 for x in decode)
    synced = {model_of[r] for r, xs in by_rank.items() for x in xs if x["endpoint"].startswith("/update_weights")}
    assert synced == {"actor"}
    # ref: one batched scoring request per prompt group (teacher and reference share it), max_new_tokens 0
    scoring = [x for x in per_model["ref"] if x["endpoint"] == "/generate" and "logprob_start_len" in x["body"]]
    assert len(scoring) == BATCH * ROLLOUTS and all(x["status"] == 200 for x in scoring)
    assert all(len(x["body"]["input_ids"]) == N_SAMPLES for x in scoring)
    assert all(x["body"]["sampling_params"]["max_new_tokens"] == 0 for x in scoring)
    # reward: one chat completion per trajectory, on the reward model's engines only
    judged = [x for x in per_model["reward"] if x["endpoint"] == "/v1/chat/completions"]
    seen = {m: Counter(x["endpoint"] for x in xs) for m, xs in per_model.items()}
    assert len(judged) == total and all(x["status"] == 200 for x in judged), seen
    assert not [x for m in ("actor", "ref") for x in per_model[m] if x["endpoint"] == "/v1/chat/completions"]

    import torch

    metrics = summary["metrics"]
    for rid in range(ROLLOUTS):
        samples = torch.load(str(dump).format(rollout_id=rid), weights_only=False)["samples"]
        assert len(samples) == BATCH * N_SAMPLES
        for s in samples:
            assert s["reward"] == (1.0 if any(c.isdigit() for c in s["response"]) else 0.25)
            assert len(s["ref_log_probs"]) == len(s["teacher_log_probs"]) == s["response_length"]
            assert s["ref_log_probs"] == s["teacher_log_probs"]
    last = metrics[str(ROLLOUTS - 1)] if str(ROLLOUTS - 1) in metrics else metrics[ROLLOUTS - 1]
    assert "train/kl_loss" in last and "train/opd_reverse_kl" in last

    # --debug-train-only replaying the dumps: the served log-probs travel in them; no engine or router starts
    replay_flags = ["--load-debug-rollout-data", str(dump)]
    replay, tree = run_slime([*base, *replay_flags], tmp_path / "train_only")
    assert replay["server_info"]["engine_pids"] == [] and replay["server_info"]["router_pid"] is None
    # (the command line itself says `--opd-type sglang`: look for the servers' own names)
    assert tree.cmdlines and tree.count("sglang::router") == 0 and tree.count("sglang_router") == 0
    assert tree.count("fake_sglang") == 0
    assert all(s["dist_initialized"] for s in replay["train_status"])
