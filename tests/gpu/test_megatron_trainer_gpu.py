"""The trainer's CUDA path (NCCL, distributed optimizer, bf16/fp32) on one GPU — the GPU nightly suite.

The CPU suite covers the same code through the gloo shim; what only a GPU can show is that the CUDA defaults
(NCCL process groups, megatron's distributed optimizer, bf16 params with fp32 main grads) work and agree with
the HF model.
"""

from __future__ import annotations

import random

import pytest
import torch

from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def trainer_and_ckpt(tmp_path_factory):
    from sim.tiny_checkpoint import build_tiny_checkpoint
    from slime.arguments import parse_args
    from slime.backends.megatron.trainer import MegatronTrainer

    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("gpu") / "model", hidden_size=128, num_layers=2)
    args = parse_args(
        [
            "--hf-checkpoint",
            str(ckpt),
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "4",
            "--num-rollout",
            "4",
            "--rollout-num-gpus",
            "1",
            "--actor-num-gpus-per-node",
            "1",
            "--lr",
            "1e-3",
            "--entropy-coef",
            "0.01",
            "--rollout-temperature",
            "0.7",
        ]  # fmt: skip
    )
    trainer = MegatronTrainer(args, 0, 1, "127.0.0.1", find_free_port())
    return trainer, ckpt, args


def _samples(n_prompts: int, n: int, vocab: int, seed: int):
    from slime.utils.types import Sample, Status

    rng = random.Random(seed)
    out = []
    for p in range(n_prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(5, 12))]
        for j in range(n):
            r = rng.randint(3, 10)
            idx = p * n + j
            out.append(
                Sample(
                    group_index=p,
                    index=idx,
                    group_id=idx,
                    tokens=prompt + [rng.randrange(3, vocab) for _ in range(r)],
                    response_length=r,
                    reward=float(rng.random() < 0.5),
                    status=Status.COMPLETED,
                    rollout_log_probs=[-rng.uniform(0.1, 8.0) for _ in range(r)],
                )
            )
    return out


def test_gpt_model_matches_hf_on_cuda(trainer_and_ckpt):
    from transformers import AutoModelForCausalLM

    trainer, ckpt, _ = trainer_and_ckpt
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
    tokens = [[5, 9, 33, 100, 7, 8], [11, 12, 13]]
    mb = {"tokens": tokens}
    with torch.no_grad():
        logits, packed = trainer._forward_logits(mb)
        start = 0
        for t in tokens:
            ref = hf(torch.tensor([t], device="cuda")).logits[0]
            got = logits[start : start + len(t), : ref.size(-1)]
            assert torch.allclose(got.float(), ref, atol=1e-3), (got - ref).abs().max()
            start += len(t)


def test_train_steps_on_cuda_with_distributed_optimizer(trainer_and_ckpt):
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer

    trainer, _, args = trainer_and_ckpt
    assert torch.distributed.get_backend() == "nccl"
    assert trainer.optimizer.config.use_distributed_optimizer
    carry = CarryBuffer()
    before = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    for rollout_id in range(2):
        samples = _samples(4, 4, trainer.spec.vocab_size, seed=rollout_id)
        rank_data, _ = build_rank_data(args, rollout_id, samples, carry, {"dp_size": 1, "cp_size": 1})
        metrics = trainer.train(rollout_id, rank_data[0])
        assert metrics["train/update_successful"] == 1.0
        assert 0 < metrics["train/grad_norm"] < float("inf")
        assert 0 < metrics["train/train_rollout_logprob_abs_diff"] < float("inf")  # random rollout log-probs
    changed = sum(not torch.equal(before[n], p) for n, p in trainer.model.module.named_parameters())
    assert changed == len(before)


def test_export_round_trips_into_hf(trainer_and_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer, ckpt, _ = trainer_and_ckpt
    trainer.save_hf(str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).cuda().eval()
    tokens = [[5, 9, 33, 100, 7, 8]]
    with torch.no_grad():
        logits, _ = trainer._forward_logits({"tokens": tokens})
        ref = hf(torch.tensor(tokens, device="cuda")).logits[0]
    # the packed row is padded to --data-pad-size-multiplier: compare the sequence's own rows
    assert torch.allclose(logits[: len(tokens[0]), : ref.size(-1)].float(), ref, atol=1e-3)


def test_fused_weight_gradient_accumulation_equals_unfused(trainer_and_ckpt):
    """On CUDA the linears accumulate weight gradients into the fp32 main grads inside the GEMM (wgrad_fusion.py):
    two bf16 micro-batches leave the same main grads as megatron's unfused add, up to bf16 rounding."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from slime.backends.megatron.model_provider import build_gpt_model, build_transformer_config
    from slime.backends.megatron.packing import pack_samples

    trainer, _, args = trainer_and_ckpt
    assert trainer.model.module.config.gradient_accumulation_fusion  # what `slime train` builds on a GPU
    state = {k: v for k, v in trainer.model.module.state_dict().items() if "_extra_state" not in k}
    rng = random.Random(3)
    rows = [[[rng.randrange(3, trainer.spec.vocab_size) for _ in range(rng.randint(20, 60))] for _ in range(3)]
            for _ in range(2)]  # fmt: skip
    grads, fused_flags = [], []
    for fused in (True, False):
        cfg = build_transformer_config(
            args, trainer.spec, gradient_accumulation_fusion=fused, bf16=True, params_dtype=torch.bfloat16
        )
        model = build_gpt_model(args, trainer.spec, config=cfg).cuda()
        model.load_state_dict(state, strict=False)
        ddp = DistributedDataParallel(
            config=cfg, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
        )
        ddp.zero_grad_buffer()
        for samples in rows:  # two micro-batches: the second accumulates onto the first
            packed = pack_samples(samples, device="cuda")
            logits = ddp(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
            torch.nn.functional.cross_entropy(logits[0].float(), packed.tokens[0]).backward()
        torch.cuda.synchronize()
        grads.append({n: p.main_grad.detach().clone() for n, p in model.named_parameters()})
        fused_flags.append(any(getattr(p, "grad_added_to_main_grad", False) for p in model.parameters()))
    assert fused_flags == [True, False]  # the fused run took the GEMM-accumulate path, the other did not
    for name, want in grads[1].items():
        got = grads[0][name]
        assert want.abs().sum() > 0, name
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 2e-2, (name, rel)
