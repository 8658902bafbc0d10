"""The set-up of one training rank, step by step (`MegatronTrainer.__init__` runs them in this order):

1. `build_models`: this rank's GPTModel chunk(s) with the HF checkpoint's weights (one chunk per virtual stage);
2. `wrap_in_ddp`: one megatron DDP per chunk (param and grad buffers);
3. `build_optimizer`: megatron's Adam over the chunks (distributed on GPU), wired into the schedule;
4. `build_scheduler`: the LR and weight-decay schedule, in megatron's units;
5. `frozen_weights`: host copies of the reference policy and the distillation teacher, when the loss needs them;
6. `load_hooks`: the import-path hooks the RL step calls.

Each is a function of what the steps before it made, so a reader (or a test) can run any prefix of them.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from collections.abc import Callable, Iterator
from typing import Any

import torch

from slime.backends.megatron.checkpoint import allocate_optimizer_state, sub_optimizers
from slime.backends.megatron.hf_config import HFModelSpec
from slime.backends.megatron.hf_weights import load_hf_weights, unwrap_model
from slime.backends.megatron.model_provider import build_gpt_model
from slime.parallel_state import ParallelState
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)


def use_distributed_optimizer(args: Namespace) -> bool:
    """On CPU the distributed optimizer needs the shim's Tensor.type() opt-in (docs/megatron_contract.md)."""
    return torch.cuda.is_available() if args.use_distributed_optimizer is None else args.use_distributed_optimizer


def build_models(args: Namespace, spec: HFModelSpec, ps: ParallelState, build_one: Callable[[], Any]) -> list[Any]:
    """This rank's model chunks: `build_one()` (the role's model: the critic's has a value head), or one chunk per
    virtual pipeline stage (each its own layers)."""
    vpp = args.virtual_pipeline_model_parallel_size or 1
    if vpp == 1:
        return [build_one()]
    models = [build_gpt_model(args, spec, vp_stage=i) for i in range(vpp)]
    if torch.cuda.is_available():
        models = [m.cuda() for m in models]
    load_hf_weights(models, args.hf_checkpoint, spec, ps)
    return models


def wrap_in_ddp(args: Namespace, models: list[Any]) -> list[Any]:
    """One megatron DDP per model chunk (virtual pipeline stages: several), bucketed as megatron's get_model does."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer(args)
    )
    config = models[0].config
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
        for i, m in enumerate(models)
    ]


def build_optimizer(args: Namespace, chunks: list[Any], *, allocate_state: bool) -> Any:
    """megatron's Adam over `chunks`, hooked into the schedule (loss scale, grad finalisation). `allocate_state`:
    Adam's moments now (inside the caller's offload region), not lazily at the first step."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
            use_distributed_optimizer=use_distributed_optimizer(args),
        ),
        chunks,
    )
    if allocate_state:
        allocate_optimizer_state(optimizer)
    if torch.cuda.is_available():
        use_fused_adam(optimizer)
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    # packed rows differ in length: megatron's p2p exchanges each micro-batch's shape first. Its interleaved
    # (virtual pipeline) schedule does not pair those exchanges up, so there every row of a schedule run is
    # padded to one length instead (`PipelineRunner.run`).
    config.variable_seq_lengths = len(chunks) == 1
    return optimizer


def use_fused_adam(optimizer: Any) -> None:
    """Run the torch AdamW under megatron's optimizer as torch's fused kernel (megatron-core falls back to the
    `foreach` one without TransformerEngine/Apex): 0.037 s instead of 0.059 s per step for 1.8B parameters on an
    H200 (bench/gpu_train.py). The fused kernel wants each step counter on its parameter's device; counters made
    on the host (fresh state, a loaded checkpoint) are moved there before every step, outside any offload region,
    so a sleeping trainer keeps them."""
    for sub in sub_optimizers(optimizer):
        inner = sub.optimizer
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False

        def steps_on_device(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            for group in opt.param_groups:
                for p in group["params"]:
                    st = opt.state.get(p)
                    if st and "step" in st and st["step"].device != p.device:
                        st["step"] = st["step"].to(device=p.device, dtype=torch.float32)

        inner.register_step_pre_hook(steps_on_device)


def build_scheduler(args: Namespace, optimizer: Any) -> Any:
    """megatron's LR schedule. Megatron's scheduler counts samples; slime's "sample" is a group, so steps are
    multiplied by the global batch size B."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    train_iters = max(1, args.num_rollout * args.rollout_batch_size * args.n_samples_per_prompt // gbs)
    decay_iters = args.lr_decay_iters or train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=max(decay_iters * gbs, args.lr_warmup_iters * gbs + 1),
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=decay_iters * gbs,
        wd_incr_style="constant",
    )


def named_parameters(chunks: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of the rank's chunks; names carry the chunk index when there are several."""
    for i, chunk in enumerate(chunks):
        for n, p in unwrap_model(chunk).named_parameters():
            yield (n if len(chunks) == 1 else f"chunk{i}.{n}"), p


def host_copy(
    args: Namespace, models: list[Any], chunks: list[Any], spec: HFModelSpec, ps: ParallelState, hf_dir: str | None
) -> dict[str, torch.Tensor]:
    """This rank's shard of `hf_dir`'s weights (None: the current ones) on the host, pinned when CUDA is there
    (55 GB/s copies back, docs/memory.md); the model chunks keep the actor's weights."""
    if hf_dir:
        load_hf_weights(models, hf_dir, spec, ps)
    out = {n: p.detach().to("cpu", copy=True) for n, p in named_parameters(chunks)}
    if torch.cuda.is_available():
        out = {n: t.pin_memory() for n, t in out.items()}
    if hf_dir:
        load_hf_weights(models, args.hf_checkpoint, spec, ps)
    return out


def frozen_weights(
    args: Namespace, models: list[Any], chunks: list[Any], spec: HFModelSpec, ps: ParallelState
) -> dict[str, dict[str, torch.Tensor]]:
    """{"ref" / "teacher": host weights}: the frozen models the actor scores against, swapped in for their passes.

    The reference policy is the initial weights (or --ref-load, an HF dir), with --ref-model-name scored on the
    rollout side instead (no copy here); the teacher (`--opd-type megatron`) has the actor's architecture."""
    out = {}
    if (args.use_kl_loss or args.kl_coef) and not args.ref_model_name:
        out["ref"] = host_copy(args, models, chunks, spec, ps, args.ref_load)
    if args.opd_type == "megatron":
        out["teacher"] = host_copy(args, models, chunks, spec, ps, args.opd_teacher_load)
    return out


def load_hooks(args: Namespace) -> dict[str, Callable[..., Any]]:
    """The RL step's import-path hooks that are set, by where they run."""
    paths = (
        ("before_log_prob", args.custom_megatron_before_log_prob_hook_path),
        ("before_train_step", args.custom_megatron_before_train_step_hook_path),
        ("postprocess", args.rollout_data_postprocess_path),
    )
    return {name: load_function(path) for name, path in paths if path}
