"""Checkpoints for exact resume: `--save/--load/--save-interval/--no-save-optim` (docs/checkpointing.md).

What a train rank writes into the directory the driver began (`slime/utils/checkpoint_dirs.py`: the layout and
its write order): `metadata.json common.pt *.distcp`, megatron.core.dist_checkpointing (torch_dist) — model,
optimizer, RNG states; common.pt holds the LR scheduler and the `slime` dict.

Why sharded (`dist_checkpointing`): every rank writes only its shard, and a checkpoint saved at one DP size
loads at another — the model is replicated over DP, and the distributed optimizer's state is saved in the
`dp_reshardable` layout (or, with `--dist-ckpt-optim-fully-reshardable`, per parameter, which also allows a TP/PP
change). A resume starts at `rollout_id + 1` with the same data, RNG and optimizer state, so with per-sample
sampling seeds it regenerates the rollout the lost run would have produced and takes the same step.

Three megatron-core 0.16.1 quirks are handled here. Without TransformerEngine/Apex (torch's own Adam) the
distributed optimizer cannot build a state dict before its first step (no `step` in the state yet), and its
loader shares one `step` tensor between all parameters and then overwrites it with the loading rank's own
value; steps are therefore saved in the common state and restored per param. And with `--bf16` its map from
model params to optimizer slots is wrong for groups mixing fp32 and bf16 params (`_fix_group_index_map`). Its
torch_dist writer, built for async saves, would also start a spawned interpreter per process to collect write
results; a synchronous save collects them in-process (`_in_process_write_results`).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from slime.utils.checkpoint_dirs import FORMAT_VERSION

logger = logging.getLogger(__name__)


# ---- trainer state (collective over all training ranks) -----------------------------------------------------
def sub_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _optimizer_steps(optimizer: Any) -> list[float | None]:
    """The torch-native Adam `step` of each sub-optimizer (all params share it), None where not kept per param."""
    steps: list[float | None] = []
    for opt in sub_optimizers(optimizer):
        values = {float(st["step"]) for st in opt.optimizer.state.values() if "step" in st}
        steps.append(values.pop() if len(values) == 1 else None)
    return steps


def allocate_optimizer_state(optimizer: Any) -> None:
    """Allocate Adam state (zeros, step 0 — what torch's Adam creates lazily at its first step) where none
    exists yet: a fresh optimizer can then describe itself for loading, and with `--offload-train` the moments
    land inside the pausable memory region instead of after it."""
    for opt in sub_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)


def _fix_group_index_map(optimizer: Any) -> None:
    """Make the distributed optimizer's (model param -> group index, order) map match its groups' real order.

    megatron-core 0.16.1 numbers the params of a group in buffer order, but fills the group with the fp32
    params first and then the fp32 copies of the bf16 ones. The two agree unless a group mixes both kinds —
    which happens with `--bf16` here, as the local spec's torch norms keep fp32 weights (Megatron-LM wraps the
    model in Float16Module, so it never sees a mixed group). Only checkpointing reads the map.
    """
    for opt in sub_optimizers(optimizer):
        if not hasattr(opt, "model_param_group_index_map") or not hasattr(opt, "model_fp32_groups"):
            continue
        for gi, (fp32, fp16) in enumerate(zip(opt.model_fp32_groups, opt.model_float16_groups, strict=True)):
            for order, model_param in enumerate([*fp32, *fp16]):
                opt.model_param_group_index_map[model_param] = (gi, order)


def _restore_steps(optimizer: Any, steps: list[float | None]) -> None:
    for opt, step in zip(sub_optimizers(optimizer), steps, strict=False):
        if step is None:
            continue
        for st in opt.optimizer.state.values():
            if "step" in st:  # one tensor per parameter: torch's Adam increments them in place
                st["step"] = torch.tensor(step, dtype=st["step"].dtype, device=st["step"].device)


def _rng_state() -> dict[str, Any]:
    import numpy as np
    from megatron.core import tensor_parallel

    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _optim_metadata(trainer: Any) -> dict[str, Any]:
    fully = bool(getattr(trainer.args, "dist_ckpt_optim_fully_reshardable", False))
    return {"distrib_optim_sharding_type": "fully_reshardable" if fully else "dp_reshardable"}


def _rng_object(ps: Any, data: Any) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # one RNG state per (pp, tp) position; DP replicas hold equal states and only replica 0 writes it
    return ShardedObject(
        "rng_state", data, (ps.size("pp"), ps.size("tp")), (ps.rank("pp"), ps.rank("tp")), replica_id=ps.rank("dp_cp")
    )


def _model_sharded_state_dict(trainer: Any) -> dict[str, Any]:
    """The model's sharded state dict: the chunk's, or `model{i}` per virtual pipeline chunk. Sharded tensors
    are keyed by global layer number, so a checkpoint loads under any TP/PP/VPP split."""
    from slime.backends.megatron.hf_weights import unwrap_model

    chunks = [unwrap_model(c) for c in trainer.chunks]
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def save_trainer_state(trainer: Any, path: str, rollout_id: int) -> None:
    """Write this rank's shard of the model, optimizer (unless `--no-save-optim`) and RNG state to `path`."""
    from megatron.core import dist_checkpointing

    args, ps = trainer.args, trainer.ps
    save_optim = not args.no_save_optim
    model_sd = _model_sharded_state_dict(trainer)
    state: dict[str, Any] = {"model": model_sd, "rng_state": _rng_object(ps, _rng_state())}
    if save_optim:
        allocate_optimizer_state(trainer.optimizer)  # a save before the first step still describes the state
        _fix_group_index_map(trainer.optimizer)
        state["optimizer"] = trainer.optimizer.sharded_state_dict(model_sd, metadata=_optim_metadata(trainer))
    state["opt_param_scheduler"] = trainer.scheduler.state_dict()
    state["slime"] = {
        "format_version": FORMAT_VERSION,
        "rollout_id": rollout_id,
        "train_step_id": int(trainer.train_step_id),
        "optimizer_steps": _optimizer_steps(trainer.optimizer) if save_optim else None,
        "saved_optim": save_optim,
        "distributed_optimizer": bool(trainer.optimizer.config.use_distributed_optimizer),
        "optim_metadata": _optim_metadata(trainer),
        "parallel": {d: ps.size(d) for d in ("tp", "pp", "dp", "cp", "ep")},
    }
    _in_process_write_results()
    dist_checkpointing.save(state, path)
    logger.info("rank %d saved its trainer state to %s", ps.global_rank, path)


def _in_process_write_results() -> None:
    """Hand megatron's torch_dist writer an in-process queue for its write results.

    Its writer collects the results of its forked writer processes into one module-level queue, by default a
    `multiprocessing.Manager` queue served by a *spawned* interpreter (~3 CPU-s and a second or more per train
    process at its first save, longer than a toy checkpoint's write). That queue exists for async saves, whose
    collecting function runs outside the training process; slime saves synchronously, so the collector runs here
    (`AsyncRequest.execute_sync`) and a `queue.Queue` carries the same results."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def load_trainer_state(trainer: Any, path: str) -> dict[str, Any]:
    """Load model, optimizer, LR schedule and RNG states from `path` (any DP size); returns the `slime` dict."""
    from megatron.core import dist_checkpointing

    from slime.backends.megatron.hf_weights import unwrap_model

    args, ps = trainer.args, trainer.ps
    common = dist_checkpointing.load_common_state_dict(path)
    meta = common["slime"]
    model_sd = _model_sharded_state_dict(trainer)
    request: dict[str, Any] = {"model": model_sd}
    load_optim = meta["saved_optim"] and not args.no_load_optim
    if load_optim:
        distributed = bool(trainer.optimizer.config.use_distributed_optimizer)
        if distributed != meta["distributed_optimizer"]:
            raise RuntimeError(
                f"{path} holds a {'distributed' if meta['distributed_optimizer'] else 'plain'} optimizer state; "
                "resume with the same --use-distributed-optimizer setting, or pass --no-load-optim"
            )
        allocate_optimizer_state(trainer.optimizer)
        _fix_group_index_map(trainer.optimizer)
        request["optimizer"] = trainer.optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=meta["optim_metadata"]
        )
    saved_layout = (meta["parallel"]["tp"], meta["parallel"]["pp"])
    load_rng = not args.no_load_rng and saved_layout == (ps.size("tp"), ps.size("pp"))
    if load_rng:
        request["rng_state"] = _rng_object(ps, None)
    state = dist_checkpointing.load(request, path)
    chunks = [unwrap_model(c) for c in trainer.chunks]
    if len(chunks) == 1:
        chunks[0].load_state_dict(state["model"], strict=True)
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state["model"][f"model{i}"], strict=True)
    if load_optim:
        with torch.no_grad():  # the distributed optimizer copies into views of parameters that require grad
            trainer.optimizer.load_state_dict(state["optimizer"])
        _restore_steps(trainer.optimizer, meta["optimizer_steps"] or [])
    else:
        trainer.optimizer.reload_model_params()  # main (fp32) params follow the loaded model params
    trainer.scheduler.load_state_dict(state["opt_param_scheduler"])
    if load_rng:
        _set_rng_state(state["rng_state"])
    else:
        logger.warning("RNG states not restored (--no-load-rng or a TP/PP change): resume is not bit-exact")
    trainer.train_step_id = int(meta["train_step_id"])
    logger.info(
        "rank %d resumed from %s (rollout %d, step %d, optimizer %s)",
        ps.global_rank, path, meta["rollout_id"], trainer.train_step_id, "loaded" if load_optim else "fresh",
    )  # fmt: skip
    return meta
