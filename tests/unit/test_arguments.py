"""Argument parsing and validation: slime's defaults, derived values and one-line errors."""

from __future__ import annotations

import json

import pytest

from slime.arguments import parse_args
from slime.utils.errors import SlimeArgError

pytestmark = pytest.mark.cpu


@pytest.fixture()
def hf_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return str(d)


def base(hf_dir: str, *extra: str) -> list[str]:
    return [
        "--hf-checkpoint", hf_dir, "--rollout-batch-size", "4", "--num-rollout", "2",
        "--rollout-num-gpus", "2", *extra,
    ]  # fmt: skip


def test_defaults_follow_slime(hf_dir):
    args = parse_args(base(hf_dir))
    assert args.lr == 1e-6 and args.clip_grad == 1.0 and args.seed == 1234 and args.micro_batch_size == 1
    assert args.rollout_seed == 42 and args.rollout_temperature == 1.0 and args.rollout_top_k == -1
    assert args.over_sampling_batch_size == 4  # defaults to rollout_batch_size
    assert args.global_batch_size == 4  # one optimizer step per rollout by default
    assert args.eps_clip_high == args.eps_clip == 0.2
    assert args.disable_grpo_std_normalization  # n_samples_per_prompt == 1 (Dr.GRPO auto)
    assert args.input_key == "input" and args.metadata_key == "metadata" and args.tool_key == "tools"
    assert args.sglang_server_concurrency == 512


def test_num_steps_per_rollout_derives_global_batch_size(hf_dir):
    args = parse_args(base(hf_dir, "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2"))
    assert args.global_batch_size == 8
    with pytest.raises(SlimeArgError, match="contradicts"):
        parse_args(base(hf_dir, "--num-steps-per-rollout", "2", "--global-batch-size", "3"))


def test_load_debug_rollout_data_implies_train_only(hf_dir):
    args = parse_args(
        ["--load-debug-rollout-data", "x_{rollout_id}.pt", "--rollout-batch-size", "2", "--num-rollout", "1"]
    )
    assert args.debug_train_only and args.hf_checkpoint is None


def test_debug_rollout_only_forces_colocate_off(hf_dir):
    args = parse_args(base(hf_dir, "--debug-rollout-only", "--colocate", "--offload"))
    assert not args.colocate and not args.offload_train and not args.offload_rollout
    assert args.actor_num_gpus_per_node == 2 and args.actor_num_nodes == 1


def test_colocate_defaults_offload_and_rollout_gpus(hf_dir):
    args = parse_args(["--hf-checkpoint", hf_dir, "--rollout-batch-size", "4", "--num-rollout", "1", "--colocate",
                       "--actor-num-gpus-per-node", "4"])  # fmt: skip
    assert args.offload_train and args.offload_rollout and args.rollout_num_gpus == 4


def test_sglang_passthrough_known_flag(hf_dir):
    args = parse_args(base(hf_dir, "--sglang-mem-fraction-static", "0.7", "--sglang-log-level", "warning"))
    assert args.sglang_mem_fraction_static == 0.7 and args.sglang_log_level == "warning"


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (("--sglang-mem-fraction-statik", "0.7"), r"--sglang-mem-fraction-statik.*--sglang-mem-fraction-static"),
        (("--sglang-mem-fraction-static", "lots"), r"mem-fraction-static.*invalid float"),
        (("--rollout-batch-sise", "3"), r"unknown flag --rollout-batch-sise; did you mean --rollout-batch-size"),
        (("--advantage-estimator", "ppo2"), r"invalid choice: 'ppo2'"),
        (("--eps-clip-c", "0.5"), r"--eps-clip-c must be > 1"),
        (("--kl-coef", "0.1", "--kl-loss-coef", "0.1"), r"only one of --kl-coef and --kl-loss-coef"),
        (("--over-sampling-batch-size", "2"), r"--over-sampling-batch-size \(2\) must be >="),
        (("--use-dynamic-batch-size",), r"needs --max-tokens-per-gpu"),
        (("--rollout-engine", "sim", "--sim-engine", "scripted"), r"needs --sim-script"),
        (("--context-parallel-size", "0"), r"--context-parallel-size and --pipeline-model-parallel-size must be >= 1"),
        (("--actor-num-gpus-per-node", "2", "--context-parallel-size", "4"), r"x --context-parallel-size 4 x"),
        (
            ("--actor-num-gpus-per-node", "4", "--context-parallel-size", "2", "--pipeline-model-parallel-size", "4"),
            r"--pipeline-model-parallel-size 4 does not divide the 4 train GPUs",
        ),
        (
            ("--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2", "--advantage-estimator", "ppo"),
            r"critic is not pipelined",
        ),
        (
            ("--actor-num-gpus-per-node", "2", "--context-parallel-size", "2", "--advantage-estimator", "ppo"),
            r"critic is not context-parallel",
        ),
    ],
)
def test_bad_flags_give_one_line(hf_dir, extra, pattern):
    with pytest.raises(SlimeArgError, match=pattern) as e:
        parse_args(base(hf_dir, *extra))
    assert "\n" not in str(e.value)


def test_missing_required(hf_dir, tmp_path):
    with pytest.raises(SlimeArgError, match="--rollout-batch-size is required"):
        parse_args(["--hf-checkpoint", hf_dir, "--num-rollout", "1", "--rollout-num-gpus", "1"])
    with pytest.raises(SlimeArgError, match="--num-rollout or --num-epoch"):
        parse_args(["--hf-checkpoint", hf_dir, "--rollout-batch-size", "1", "--rollout-num-gpus", "1"])
    with pytest.raises(SlimeArgError, match="no config.json"):
        parse_args(base(str(tmp_path)))
    with pytest.raises(SlimeArgError, match="--rollout-num-gpus is required"):
        parse_args(["--hf-checkpoint", hf_dir, "--rollout-batch-size", "1", "--num-rollout", "1"])


def test_custom_config_yaml(hf_dir, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout-temperature: 0.5\nn_samples_per_prompt: 8\n")
    args = parse_args(base(hf_dir, "--custom-config-path", str(cfg)))
    assert args.rollout_temperature == 0.5 and args.n_samples_per_prompt == 8
    assert args.global_batch_size == 32  # derived after the YAML is applied
    cfg.write_text("rollout_temprature: 0.5\n")
    with pytest.raises(SlimeArgError, match="unknown key 'rollout_temprature'; did you mean rollout_temperature"):
        parse_args(base(hf_dir, "--custom-config-path", str(cfg)))
    cfg.write_text("a: [1,\n")
    with pytest.raises(SlimeArgError, match=r"c.yaml:\d+: invalid YAML"):
        parse_args(base(hf_dir, "--custom-config-path", str(cfg)))


def test_context_parallel_is_accepted(hf_dir):
    args = parse_args(base(hf_dir, "--actor-num-gpus-per-node", "4", "--context-parallel-size", "2",
                           "--pipeline-model-parallel-size", "2"))  # fmt: skip
    assert (args.context_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
