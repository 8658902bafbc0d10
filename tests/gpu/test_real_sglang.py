"""Real SGLang in the loop, on one GPU: the same `slime train` CLI a user runs, with `--rollout-engine sglang`.

- Colocated toy task (`--colocate --bf16`): after every weight sync the engine's weights equal the trainer's,
  checked by the engine's own `/weights_checker` checksums against slime's hash of what it sent (SGLang's fused
  names, its GPU hash: `--check-weight-update-equal`); the trainer's log-probs of the sampled tokens agree with
  the engine's within bf16 noise; while the trainer trains the engine's memory is released (the trainer reads the
  device's free memory) and every rollout after the first ran on the resumed engine.
- Partial rollout against a real engine behind the real router: aborted samples come back with their tokens and
  log-probs, the next rollout continues them from those tokens, nothing is lost.

Tolerance for `train/train_rollout_logprob_abs_diff` (mean over response tokens of |trainer - engine| log-prob):
both sides compute the same bf16 model with different kernels (SGLang: triton attention, its fused RMSNorm/RoPE/
SiLU kernels, bf16 matmuls; the trainer: megatron-core with torch SDPA) and summation orders. bf16 keeps 8 bits of
mantissa, so each logit carries a relative error around 2**-8 ≈ 0.4%; on logits of magnitude ~1-3 that is ~1e-2
per token, and the mean over tokens stays at that size (the fake `hf` engine measured 0.014-0.016 on the ~1.2B
shape). 0.05 leaves room for kernel differences while failing on any real mismatch: stale or partially loaded
weights change the log-probs by whole nats.

Skipped where the SGLang interpreter (`SLIME_SGLANG_PYTHON`, default the offline pack's `.sgl-site/bin/python`,
docs/offline_gpu.md) imports no SGLang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = os.environ.get("SLIME_SGLANG_PYTHON", str(ROOT / ".sgl-site" / "bin" / "python"))
MEAN_TOL = 0.05
ROLLOUTS = 5
# SGLang's server flags for these runs: triton attention and torch sampling (no FA3 / JIT flashinfer needed), no
# CUDA graphs (start-up in seconds; the throughput bench runs with them), a third of the GPU for the engine
SERVER_FLAGS = ["--sglang-attention-backend", "triton", "--sglang-sampling-backend", "pytorch",
                "--sglang-disable-cuda-graph", "--sglang-mem-fraction-static", "0.3"]  # fmt: skip


def _sglang_version() -> str | None:
    if not Path(SGLANG_PYTHON).exists():
        return None
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    out = subprocess.run([SGLANG_PYTHON, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    return out.stdout.strip() or None


SGLANG_VERSION = _sglang_version()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(SGLANG_VERSION is None, reason=f"no SGLang importable by {SGLANG_PYTHON}"),
]


@pytest.fixture(scope="module")
def toy64(tmp_path_factory) -> Path:
    """The toy task with a head_dim-64 model (SGLang's rope and KV kernels are prebuilt for 64 and 128)."""
    out = tmp_path_factory.mktemp("real_sglang_toy")
    subprocess.run([sys.executable, "-m", "examples.toy.prepare", "--out", str(out), "--num-train", "64",
                    "--num-eval", "4", "--hidden-size", "256", "--num-heads", "4", "--num-kv-heads", "2",
                    "--intermediate-size", "512"], check=True, cwd=ROOT, timeout=300)  # fmt: skip
    return out


def test_colocated_toy_syncs_exact_weights_into_real_sglang_and_releases_its_memory(toy64, tmp_path) -> None:
    from sim.slime_run import run_slime_train

    out = tmp_path / "run"
    argv = [
        "--hf-checkpoint", str(toy64 / "model"), "--prompt-data", str(toy64 / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm",
        "--rollout-engine", "sglang", "--sglang-python", SGLANG_PYTHON, *SERVER_FLAGS,
        "--colocate", "--bf16", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
        "--num-rollout", str(ROLLOUTS), "--rollout-max-response-len", "16", "--lr", "1e-4", "--seed", "1234",
        "--check-weight-update-equal", "--metrics-dir", str(out), "--no-use-tensorboard",
    ]  # fmt: skip
    log = tmp_path / "run.log"
    assert run_slime_train(argv, log, timeout=540) == 0, log.read_text()[-6000:]
    text = log.read_text() + "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert f"rollout engine: SGLang {SGLANG_VERSION}" in text
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r["metrics"] for r in records if r["kind"] == "train"]
    assert len(train) == ROLLOUTS
    total = torch.cuda.mem_get_info()[1]
    for m in train:
        # the engine's checksums, in its own names and hash, equal slime's of every tensor it sent
        assert m["weight_sync/checked_engines"] == 1 and m["weight_sync/checked_tensors"] > 0, m
        assert m["train/train_rollout_logprob_abs_diff"] < MEAN_TOL, m
        # the engine (30% of the GPU for weights and KV cache) had let its memory go when the trainer began
        assert total - m["memory/device_free_at_train_bytes"] < 0.25 * total, m
    print(json.dumps([{k: v for k, v in m.items() if k.startswith(("time/", "weight_sync/", "train/train_rollout",
                                                                  "memory/device"))} for m in train], indent=1))  # fmt: skip


def length_rm(args, sample) -> float:
    return float(sample.response_length)


def test_partial_rollout_continues_aborted_samples_from_their_tokens(toy64, tmp_path, make_args) -> None:
    """Real SGLang behind the real router, serving 4 requests at a time: once 2 groups are accepted the rest are
    aborted mid-generation; they come back with their tokens and log-probs, go to the buffer, and the next rollout
    continues them from those tokens (prompt + earlier response sent back), so no group is lost or restarted."""
    from slime.backends.sglang.router import RouterProcess
    from slime.backends.sglang.server_args import build_server_argv
    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.rollout.sglang_rollout import generate_rollout
    from slime.utils.http_utils import find_free_port
    from slime.utils.process import ManagedProcess
    from slime.utils.types import Status

    max_len = 256
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"input": f"prompt {i}"}) + "\n" for i in range(8)))
    args = make_args(
        prompt_data=str(data), hf_checkpoint=str(toy64 / "model"), n_samples_per_prompt=2, rollout_batch_size=2,
        over_sampling_batch_size=8, rollout_seed=1, rollout_max_response_len=max_len, partial_rollout=True,
        custom_rm_path=f"{__name__}.length_rm", sglang_python=SGLANG_PYTHON,
        sglang_max_running_requests=4, sglang_attention_backend="triton", sglang_sampling_backend="pytorch",
        sglang_disable_cuda_graph=True, sglang_mem_fraction_static=0.3, bf16=True,
    )  # fmt: skip
    args.sglang_version = SGLANG_VERSION
    eport, rport = find_free_port(), find_free_port()
    argv = build_server_argv(args, backend="sglang", host="127.0.0.1", port=eport, nccl_port=find_free_port())
    engine = ManagedProcess.start(argv, name="sglang", log_path=str(tmp_path / "sglang.log"))
    router = None
    try:
        engine.wait_healthy(f"http://127.0.0.1:{eport}/health_generate", timeout=400, interval=1.0)
        router = RouterProcess.start(args, host="127.0.0.1", port=rport, log_file=str(tmp_path / "router.log"))
        router.add_worker(f"http://127.0.0.1:{eport}")
        args.sglang_router_ip, args.sglang_router_port = "127.0.0.1", rport
        ds = RolloutDataSourceWithBuffer(args)
        first = generate_rollout(args, 0, ds)
        assert len(first.samples) == 2
        partial = [s for g in ds.buffer for s in g if s.status == Status.ABORTED and s.response_length > 0]
        assert partial, "no group was cut mid-generation"
        for s in partial:
            assert 0 < s.response_length < max_len and len(s.rollout_log_probs) == s.response_length
        before = {s.index: list(s.tokens) for s in partial}
        waiting = {s.index for g in ds.buffer for s in g}
        second = generate_rollout(args, 1, ds)
        resumed = [s for g in second.samples for s in g if s.index in before]
        for s in resumed:  # continued, not restarted: the earlier tokens are the prefix of the final ones
            assert s.tokens[: len(before[s.index])] == before[s.index], s.index
            assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.metadata["start_rollout_id"] == 0
        assert resumed, "no partial sample was trained in the next rollout"
        # nothing lost: what waited in the buffer was trained now or still waits
        assert waiting <= {s.index for g in second.samples for s in g} | {s.index for g in ds.buffer for s in g}
    finally:
        if router is not None:
            router.stop(grace=10)
        engine.stop(grace=20)
