"""`MegatronTrainer`: one training rank — megatron-core model, DDP, optimizer, LR schedule, the RL train step.

One `train(rollout_id, data)` call consumes this rank's share of a rollout (built on the rollout side by
`slime/scheduling`): π_old (and π_ref) log-probs are recomputed with the same micro-batches, advantages are
computed, then every optimizer step runs megatron's forward-backward schedule over its micro-batches with the
group normaliser of `slime/algorithms/reducers.py`. A partial last step of b < B groups divides its loss by b
and advances the LR schedule by b.
"""

from __future__ import annotations

import logging
import time
from argparse import Namespace
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

import torch

from slime.algorithms.advantages import compute_advantages_and_returns, distributed_masked_whiten, opd_inputs
from slime.algorithms.logprobs import packed_response_logprobs_and_entropy, score_rows
from slime.algorithms.loss import loss_function
from slime.algorithms.opd import apply_opd
from slime.algorithms.ppo import ppo_advantages
from slime.algorithms.reducers import reduce_train_metrics, scale_for_megatron
from slime.backends.megatron.checkpoint import allocate_optimizer_state
from slime.backends.megatron.context_parallel import (
    gather_responses,
    local_part,
    local_response_rows,
    shard_row_for_cp,
    whole_sample_state,
)
from slime.backends.megatron.hf_config import read_hf_config
from slime.backends.megatron.hf_weights import export_hf_weights, load_hf_weights, unwrap_model
from slime.backends.megatron.initialize import init_distributed, init_megatron, run_custom_megatron_init
from slime.backends.megatron.model_provider import (
    build_gpt_model,
    clear_moe_tracker,
    mask_padded_vocab,
    moe_load_balancing_loss,
)
from slime.backends.megatron.offload import PhaseMemory, no_region
from slime.backends.megatron.packing import PackedBatch, pack_samples, row_pad_multiple
from slime.backends.megatron.pipeline_runs import ModelChunks, current_device
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)

_EMPTY = object()  # marks a padding micro-batch (a rank with nothing to do in a step still joins the schedule)


def use_fused_adam(optimizer: Any) -> None:
    """Run the torch AdamW under megatron's optimizer as torch's fused kernel (megatron-core falls back to the
    `foreach` one without TransformerEngine/Apex): 0.037 s instead of 0.059 s per step for 1.8B parameters on an
    H200 (bench/gpu_train.py). The fused kernel wants each step counter on its parameter's device; counters made
    on the host (fresh state, a loaded checkpoint) are moved there before every step, outside any offload region,
    so a sleeping trainer keeps them."""
    from slime.backends.megatron.checkpoint import sub_optimizers

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


class MegatronTrainer(ModelChunks):
    metric_prefix = "train/"

    def __init__(
        self,
        args: Namespace,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        *,
        node_ip: str | None = None,
        listen: Any = None,
        offloader: Any = None,
    ) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.args = args
        self.offloader = offloader  # offload.py, set up by the train actor; None: never asleep
        region = offloader.region if offloader is not None else no_region
        init_distributed(args, rank, world_size, master_addr, master_port, node_ip=node_ip, listen=listen)
        self.ps = init_megatron(args)
        self.spec = read_hf_config(args.hf_checkpoint)
        # On CPU the distributed optimizer needs the shim's Tensor.type() opt-in (docs/megatron_contract.md).
        distributed_optimizer = args.use_distributed_optimizer
        if distributed_optimizer is None:
            distributed_optimizer = torch.cuda.is_available()
        with region("model"):  # the model and its DDP param/grad buffers
            models = self._build_models()
            config = models[0].config
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
            )
            # one DDP per model chunk (virtual pipeline stages: several), bucketed as megatron's get_model does
            self.chunks = [
                DistributedDataParallel(config=config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
                for i, m in enumerate(models)
            ]
            # the rank's model when it is one chunk (everything but virtual pipeline stages); None otherwise, so
            # that code written for one chunk fails loudly instead of seeing part of the model
            self.model = self.chunks[0] if len(self.chunks) == 1 else None
        with region("optimizer"):  # fp32 master params and Adam's moments
            self.optimizer = get_megatron_optimizer(
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
                    use_distributed_optimizer=distributed_optimizer,
                ),
                self.chunks,
            )
            if offloader is not None and offloader.enabled:
                allocate_optimizer_state(self.optimizer)  # Adam's moments now (inside the region), not at step 1
        if torch.cuda.is_available():
            use_fused_adam(self.optimizer)
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        # packed rows differ in length: megatron's p2p exchanges each micro-batch's shape first. Its interleaved
        # (virtual pipeline) schedule does not pair those exchanges up, so there every row of a schedule run is
        # padded to one length instead (`_run_schedule`).
        config.variable_seq_lengths = len(self.chunks) == 1
        self._pad_to: int | None = None
        self._sync_sources: list[Any] | None = None  # weights_for_sync's views, built at the first sync
        # Megatron's scheduler counts samples; slime's "sample" is a group, so steps are multiplied by B.
        gbs = args.global_batch_size
        train_iters = max(1, args.num_rollout * args.rollout_batch_size * args.n_samples_per_prompt // gbs)
        decay_iters = args.lr_decay_iters or train_iters
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
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
        self.ref_params: dict[str, torch.Tensor] | None = None
        if (args.use_kl_loss or args.kl_coef) and not args.ref_model_name:
            # The reference policy: the initial weights (or --ref-load, an HF dir), kept on the host. With
            # --ref-model-name an SGLang model scores it on the rollout side and no copy is kept here.
            self.ref_params = self._host_copy(models, args.ref_load)
        # --opd-type megatron: the teacher (same architecture) as a pinned host copy, swapped in for its forward
        self.teacher_params = self._host_copy(models, args.opd_teacher_load) if args.opd_type == "megatron" else None
        cp = self.ps.size("cp")
        sp = self.ps.size("tp") if args.sequence_parallel else 1
        self.pad_multiple = row_pad_multiple(args.data_pad_size_multiplier, cp, sp)
        self._hooks = {
            name: load_function(path)
            for name, path in (
                ("before_log_prob", args.custom_megatron_before_log_prob_hook_path),
                ("before_train_step", args.custom_megatron_before_train_step_hook_path),
                ("postprocess", args.rollout_data_postprocess_path),
            )
            if path
        }
        self.weight_version = 0
        self.train_step_id = 0

    def _host_copy(self, models: list[Any], hf_dir: str | None) -> dict[str, torch.Tensor]:
        """This rank's shard of `hf_dir`'s weights (None: the current ones) on the host, pinned when CUDA is there
        (55 GB/s copies back, docs/memory.md); the model chunks keep the actor's weights."""
        if hf_dir:
            load_hf_weights(models, hf_dir, self.spec, self.ps)
        pin = torch.cuda.is_available()
        out = {n: p.detach().to("cpu", copy=True) for n, p in self.named_parameters()}
        if pin:
            out = {n: t.pin_memory() for n, t in out.items()}
        if hf_dir:
            load_hf_weights(models, self.args.hf_checkpoint, self.spec, self.ps)
        return out

    def _build_model(self) -> Any:
        """This rank's GPTModel with the HF checkpoint's weights (the critic replaces it: critic.py)."""
        model = build_gpt_model(self.args, self.spec)
        if torch.cuda.is_available():
            model = model.cuda()
        load_hf_weights(model, self.args.hf_checkpoint, self.spec, self.ps)
        return model

    # ---- forward helpers ------------------------------------------------------------------------------------
    def _forward_logits(self, mb: dict[str, Any], model: Any = None) -> tuple[torch.Tensor, PackedBatch]:
        packed = self._pack(mb)
        tokens, positions = packed.model_inputs()
        model = model if model is not None else self.model
        logits = model(tokens, positions, None, packed_seq_params=packed.packed_seq_params)
        return mask_padded_vocab(logits[0], self.spec.vocab_size, self.ps.rank("tp")), packed

    def _pack(self, mb: dict[str, Any]) -> PackedBatch:
        """The micro-batch as one THD row (an empty micro-batch runs one dummy token, to join the schedule)."""
        tokens = mb["tokens"] if mb["tokens"] else [[0]]
        prompts = None
        if self.args.share_prompt_prefix and mb["tokens"] and "response_lengths" in mb:
            prompts = [t - r for t, r in zip(mb["total_lengths"], mb["response_lengths"], strict=True)]
        packed = pack_samples(
            tokens,
            pad_multiple=self.pad_multiple,
            device=current_device(),
            prompt_lengths=prompts,
            pad_to=self._pad_to,
        )
        if mb["tokens"] and "total_lengths" in mb and packed.lengths != list(mb["total_lengths"]):
            raise ValueError(f"micro-batch token counts {packed.lengths} differ from total_lengths")
        if self.ps.size("cp") > 1:
            shard_row_for_cp(packed, self.ps)
        return packed

    def _logprobs(
        self, logits: torch.Tensor, mb: dict[str, Any], packed: PackedBatch, with_entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """(log-probs, entropies, picked) of the response tokens this rank scores. `picked` is None when they
        are whole responses; with CP, each sample's response indices scored here (context_parallel.py)."""
        if packed.cp_rows is not None:
            pred, target_rows, picked = local_response_rows(packed, mb["response_lengths"])
            lp, ent = score_rows(
                logits,
                pred,
                packed.tokens.reshape(-1).index_select(0, target_rows),
                [int(js.numel()) for js in picked],
                self.ps,
                temperature=self.args.rollout_temperature,
                vocab_start=self.ps.rank("tp") * logits.size(-1),
                with_entropy=with_entropy,
                chunk_size=self.args.log_probs_chunk_size,
            )
            return lp, ent, picked
        lp, ent = packed_response_logprobs_and_entropy(
            logits,
            packed.tokens,
            # the rows of each response and of the token before it: all the reader scores
            [packed.sample_rows(i, last=r + 1) for i, r in enumerate(mb["response_lengths"])],
            mb["response_lengths"],
            self.ps,
            temperature=self.args.rollout_temperature,
            vocab_start=self.ps.rank("tp") * logits.size(-1),
            with_entropy=with_entropy,
            chunk_size=self.args.log_probs_chunk_size,
        )
        return lp, ent, None

    def _microbatches(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        """Per-sample fields of each micro-batch, in schedule order (steps concatenated)."""
        per_sample = ("tokens", "total_lengths", "response_lengths", "loss_masks", "group_mask_sums", "rewards")
        optional = [k for k in ("rollout_log_probs", "teacher_log_probs", "ref_log_probs") if k in data]
        out = []
        for idx in data["micro_batch_indices"]:
            mb = {k: [data[k][i] for i in idx] for k in (*per_sample, *optional)}
            mb["indices"] = list(idx)
            out.append(mb)
        return out

    def _logprob_batches(self, mbs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[tuple[int, int]]]]:
        """The micro-batches of the no-grad log-prob passes, each with where its samples go back (mb, position).

        By default they are the training micro-batches. `--log-probs-max-tokens-per-gpu` regroups the rank's
        samples, in order, into batches of at most that many tokens (no activations are kept, so larger batches
        fit, and siblings of one prompt share its rows more often); a longer sample runs alone."""
        if self.args.log_probs_max_tokens_per_gpu is None:
            return [(mb, [(j, p) for p in range(len(mb["tokens"]))]) for j, mb in enumerate(mbs)]
        cap = self.args.log_probs_max_tokens_per_gpu
        out: list[tuple[dict[str, Any], list[tuple[int, int]]]] = []
        cur: dict[str, Any] = {"tokens": [], "total_lengths": [], "response_lengths": []}
        targets: list[tuple[int, int]] = []
        for j, mb in enumerate(mbs):
            for p, (t, n, r) in enumerate(zip(mb["tokens"], mb["total_lengths"], mb["response_lengths"], strict=True)):
                if cur["tokens"] and sum(cur["total_lengths"]) + n > cap:
                    out.append((cur, targets))
                    cur, targets = {"tokens": [], "total_lengths": [], "response_lengths": []}, []
                cur["tokens"].append(t)
                cur["total_lengths"].append(n)
                cur["response_lengths"].append(r)
                targets.append((j, p))
        if cur["tokens"]:
            out.append((cur, targets))
        return out

    @torch.no_grad()
    def _compute_logprobs(self, mbs: list[dict[str, Any]], key: str, store_prefix: str = "") -> None:
        """Fill `mb[key]` with per-sample response log-probs of the current weights (no grad)."""
        if "before_log_prob" in self._hooks:
            self._hooks["before_log_prob"](self.args, self.chunks, store_prefix)
        self._set_mode(False)
        for mb in mbs:
            mb[key] = [None] * len(mb["tokens"])
        batches = [(b, t) for b, t in self._logprob_batches(mbs) if b["tokens"]]
        if self.ps.size("ep") > 1:  # MoE: the token all-to-all is an EP collective, so every EP rank runs as many
            empty = {"tokens": [], "total_lengths": [], "response_lengths": []}  # forwards (a dummy row each)
            batches += [(dict(empty), [])] * self._ep_padding(len(batches))
        if self.ps.size("pp") > 1:
            self._pipelined_logprobs(batches, mbs, key)
        for batch, targets in batches if self.ps.size("pp") == 1 else []:
            logits, packed = self._forward_logits(batch)
            if not batch["tokens"]:  # an EP padding forward: nothing to score
                continue
            for (j, p), x in zip(targets, self._batch_logprobs(logits, batch, packed), strict=True):
                mbs[j][key][p] = x  # computed under no_grad: nothing to detach
        self._set_mode(True)

    def _ep_padding(self, count: int) -> int:
        """How many empty forwards this rank adds so that its EP group runs the same number."""
        most = self.ps.all_reduce(torch.tensor([count], dtype=torch.float64), "max", "ep")
        return int(most.item()) - count

    def _batch_logprobs(self, logits: torch.Tensor, batch: dict[str, Any], packed: PackedBatch) -> list[torch.Tensor]:
        """Whole per-sample response log-probs of one batch's logits (under CP gathered back in sample order)."""
        lp, _, picked = self._logprobs(logits.float(), batch, packed, with_entropy=False)
        if picked is not None:  # CP: whole responses, in sample order, on every CP rank
            lp = gather_responses(lp, picked, batch["response_lengths"], self.ps)
        return lp

    @torch.no_grad()
    def _swap_params(self, source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        saved = {}
        for n, p in self.named_parameters():
            saved[n] = p.detach().to("cpu", copy=True)
            p.copy_(source[n].to(p.device))
        return saved

    # ---- the RL step ----------------------------------------------------------------------------------------
    def train_rollout(
        self, rollout_id: int, data: dict[str, Any], values: list[list[float]] | None = None
    ) -> tuple[dict[str, float], list[list[float]] | None]:
        """One rollout as the backend runs every role: (metrics, what the role hands on — the critic's values)."""
        return self.train(rollout_id, data, values), None

    def train(
        self, rollout_id: int, data: dict[str, Any], values: list[list[float]] | None = None
    ) -> dict[str, float]:
        """One rollout's optimizer steps. `values` (PPO): the critic's old values of this rank's samples, in
        train-data order, from the critic worker of the same rank."""
        run_custom_megatron_init(self.args)  # the CPU shim's torch mode is per thread; cheap when repeated
        args = self.args
        timings: dict[str, float] = {}
        memory = PhaseMemory()
        t0 = time.perf_counter()
        mbs = self._microbatches(data)
        ppo = args.advantage_estimator == "ppo"
        if ppo:
            if values is None:
                raise ValueError("--advantage-estimator ppo: the actor needs the critic's values")
            for mb in mbs:
                mb["values"] = [
                    torch.tensor(values[i], dtype=torch.float32, device=current_device()) for i in mb["indices"]
                ]
        # sft_loss reads only the live forward's log-probs, so the old-policy pass would be a wasted forward.
        needs_old = args.loss_type != "sft_loss"
        recompute = needs_old and (not args.use_rollout_logprobs or args.get_mismatch_metrics)
        if recompute:
            self._compute_logprobs(mbs, "log_probs")
        elif needs_old and "rollout_log_probs" in data:
            for mb in mbs:
                mb["log_probs"] = [
                    torch.tensor(x, dtype=torch.float32, device=current_device()) for x in mb["rollout_log_probs"]
                ]
        for key, params, prefix in (("ref_log_probs", self.ref_params, "ref_"),
                                    ("teacher_log_probs", self.teacher_params, "teacher_")):  # fmt: skip
            if params is not None:
                actor = self._swap_params(params)
                self._compute_logprobs(mbs, key, store_prefix=prefix)
                self._swap_params(actor)
        timings["time/log_probs"] = time.perf_counter() - t0
        memory.end("actor_log_probs")
        for mb in mbs:
            self._prepare_batch(mb)
        if ppo and not args.custom_advantage_function_path and not args.disable_compute_advantages_and_returns:
            self._rank_advantages(mbs, data)
        if "postprocess" in self._hooks:
            self._postprocess(rollout_id, data, mbs)
        metrics: dict[str, float] = {}
        if "rollout_log_probs" in data and recompute:
            # the mean train_rollout_logprob_abs_diff hides one wrong position; the max over trained tokens does not
            metrics["train/train_rollout_logprob_abs_diff_max"] = self._max_rollout_logprob_diff(mbs)
        t1 = time.perf_counter()
        metrics.update(self._run_steps(rollout_id, data, mbs))
        timings["time/train"] = time.perf_counter() - t1
        memory.end("actor_train")
        metrics.update(timings)
        metrics.update(memory.metrics())
        metrics["train/tokens_per_s"] = metrics.pop("_tokens") / max(timings["time/train"], 1e-9)
        if (
            self.ref_params is not None
            and args.ref_update_interval
            and (rollout_id + 1) % args.ref_update_interval == 0
        ):
            # --ref-update-interval: the reference policy becomes the current actor
            self.ref_params = {n: p.detach().to("cpu", copy=True) for n, p in self.named_parameters()}
        return metrics

    def _run_steps(self, rollout_id: int, data: dict[str, Any], mbs: list[dict[str, Any]]) -> dict[str, float]:
        """Every optimizer step of the rollout; step metrics averaged over the steps (`_tokens`: tokens run)."""
        pre = self.metric_prefix
        metrics: dict[str, float] = {}
        step_start = num_tokens = 0
        for step, n_mb in enumerate(data["num_microbatches"]):
            step_mbs = mbs[step_start : step_start + n_mb]
            step_start += n_mb
            b = data["global_batch_sizes"][step]
            if "before_train_step" in self._hooks:
                self._hooks["before_train_step"](
                    self.args, rollout_id, step, self.chunks, self.optimizer, self.scheduler
                )
            step_metrics = self._optimizer_step(step_mbs, b)
            num_tokens += sum(sum(mb["total_lengths"]) for mb in step_mbs)
            for k, v in step_metrics.items():
                metrics[k] = metrics.get(k, 0.0) + v / len(data["num_microbatches"])
        metrics["_tokens"] = float(num_tokens)
        metrics[f"{pre}samples"] = float(sum(len(mb["tokens"]) for mb in mbs))
        metrics[f"{pre}steps"] = float(len(data["num_microbatches"]))
        metrics[f"{pre}lr"] = float(self.optimizer.param_groups[0]["lr"])
        return metrics

    def _max_rollout_logprob_diff(self, mbs: list[dict[str, Any]]) -> float:
        """max |ℓ_recomputed − ℓ_engine| over loss-masked response tokens of every rank (0 when there are none)."""
        m = torch.zeros((), dtype=torch.float64, device=current_device())
        for mb in mbs:
            if len(mb.get("log_probs", [])) != len(mb["rollout_log_probs"]):
                raise ValueError("recomputed and rollout log-probs cover different samples")
            if not mb["rollout_log_probs"]:
                continue
            lp = torch.cat(mb["log_probs"]).to(torch.float64)
            roll = torch.cat(mb["rollout_log_probs"]).to(lp.device, torch.float64)
            mask = torch.cat(mb["loss_masks"]).to(lp.device) > 0
            if lp.numel():
                m = torch.maximum(m, ((lp - roll).abs() * mask).max())
        return float(self.ps.all_reduce(m, "max", "dp_cp"))

    def _prepare_batch(self, mb: dict[str, Any]) -> None:
        """Turn one micro-batch's lists into the tensors `loss_function` expects (CP=1: responses whole)."""
        dev = current_device()
        mb["loss_masks"] = [torch.tensor(m, dtype=torch.float32, device=dev) for m in mb["loss_masks"]]
        for key in ("rollout_log_probs", "teacher_log_probs", "ref_log_probs"):  # lists from the rollout side
            if key in mb:
                mb[key] = [torch.as_tensor(x, dtype=torch.float32, device=dev) for x in mb[key]]
        batch = {
            "rewards": mb["rewards"],
            "loss_masks": mb["loss_masks"],
            "response_lengths": mb["response_lengths"],
            "total_lengths": mb["total_lengths"],
        }
        for k in ("log_probs", "ref_log_probs", "teacher_log_probs", "rollout_log_probs", "values"):
            if k in mb:
                batch[k] = mb[k]
        ppo_builtin = self.args.advantage_estimator == "ppo" and not self.args.custom_advantage_function_path
        if not mb["tokens"]:
            mb["advantages"] = mb["returns"] = []
        elif not self.args.disable_compute_advantages_and_returns and not ppo_builtin:
            # whole samples here, also under CP (the CP ranks of a DP rank hold the same ones)
            compute_advantages_and_returns(self.args, batch, whole_sample_state(self.ps))
            mb["advantages"], mb["returns"] = batch["advantages"], batch["returns"]

    def _rank_advantages(self, mbs: list[dict[str, Any]], data: dict[str, Any], kl_coef: float | None = None) -> None:
        """PPO: GAE over all of this rank's samples at once (a fan-out group's segments are chained, over DP
        too), written back into each micro-batch's `advantages` / `returns`."""
        order = [(j, p) for j, mb in enumerate(mbs) for p in range(len(mb["tokens"]))]
        flat: dict[str, list[Any]] = {}
        for key in ("rewards", "loss_masks", "total_lengths", "response_lengths", "values", "log_probs", "ref_log_probs", "rollout_log_probs", "teacher_log_probs"):  # fmt: skip
            if all(key in mbs[j] for j, _ in order):  # a rank without samples still joins the collectives
                flat[key] = [mbs[j][key][p] for j, p in order]
        for key in ("batch_positions", "next_segments"):
            flat[key] = [data[key][mbs[j]["indices"][p]] for j, p in order]
        adv, ret = ppo_advantages(self.args, flat, self.ps, kl_coef=kl_coef)
        if self.args.use_opd:
            adv = apply_opd(adv, *opd_inputs(self.args, flat), self.args.opd_kl_coef)
        if self.args.normalize_advantages:
            adv = distributed_masked_whiten(adv, [torch.as_tensor(m) for m in flat.get("loss_masks", [])], self.ps)
        for mb in mbs:
            mb["advantages"], mb["returns"] = [], []
        for (j, _), a, r in zip(order, adv, ret, strict=True):
            mbs[j]["advantages"].append(a)
            mbs[j]["returns"].append(r)

    # per-sample keys a --rollout-data-postprocess-path hook sees, and may replace, on the train side
    POSTPROCESS_KEYS = (
        "loss_masks",
        "rewards",
        "log_probs",
        "ref_log_probs",
        "rollout_log_probs",
        "teacher_log_probs",
        "advantages",
        "returns",
    )

    def _postprocess(self, rollout_id: int, data: dict[str, Any], mbs: list[dict[str, Any]]) -> None:
        """`--rollout-data-postprocess-path(args, rollout_id, rollout_data)`: this rank's samples as lists in
        train-data order (slime's signature), after log-probs and advantages; what it writes back is trained on.
        Group denominators stay those of the rollout-side loss masks."""
        n = len(data["tokens"])
        view = {k: list(v) for k, v in data.items() if isinstance(v, list) and len(v) == n}
        for key in self.POSTPROCESS_KEYS:
            if all(key in mb for mb in mbs):
                col: list[Any] = [None] * n
                for mb in mbs:
                    for i, x in zip(mb["indices"], mb[key], strict=True):
                        col[i] = x
                view[key] = col
        self._hooks["postprocess"](self.args, rollout_id, view)
        for key in self.POSTPROCESS_KEYS:
            if key in view:
                if len(view[key]) != n:
                    raise ValueError(f"rollout data postprocess: {key!r} has {len(view[key])} entries, expected {n}")
                for mb in mbs:
                    mb[key] = [view[key][i] for i in mb["indices"]]

    def _optimizer_step(self, step_mbs: list[dict[str, Any]], global_batch_size: int) -> dict[str, float]:

        args = self.args
        per_token = args.calculate_per_token_loss
        sums: dict[str, float] = {}
        local_tokens = 0.0
        packed_rows = 0  # tokens the model actually ran on (fewer than the samples' with shared prompts)
        n_mb = len(step_mbs)

        def loss_func(mb: dict[str, Any], packed: PackedBatch, logits: torch.Tensor):
            nonlocal local_tokens
            if not mb["tokens"]:
                zero = logits.sum() * 0.0  # keeps every parameter in the graph; contributes nothing
                # per-token mode counts the step's tokens: an empty micro-batch has none
                return zero, torch.tensor(0 if per_token else 1, dtype=torch.int), {}
            loss, m = self._micro_batch_loss(mb, packed, logits)
            scaled, num_tokens = scale_for_megatron(
                loss,
                num_microbatches=n_mb,
                global_batch_size=global_batch_size,
                dp_cp_size=self.ps.size("dp_cp"),
                cp_size=self.ps.size("cp"),
                per_token=per_token,
                sample_token_counts=[int(sum(x.tolist())) for x in mb["loss_masks"]] if per_token else None,
            )
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            local_tokens += float(num_tokens)
            return scaled, num_tokens, {}

        def forward_step(it: Iterator[dict[str, Any]], model: Any):
            nonlocal packed_rows
            mb = next(it)
            logits, packed = self._stage_forward(mb, model)
            packed_rows += packed.total_len - packed.pad if mb["tokens"] else 0
            return logits, partial(loss_func, mb, packed)

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.spec.is_moe:
            clear_moe_tracker()
        self._run_schedule(forward_step, step_mbs, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=global_batch_size)
        self.train_step_id += 1
        if self.ps.size("dp_cp") > 1:
            # A rank whose micro-batches were all empty has no metric names; the all-reduce needs the same keys.
            import torch.distributed as dist

            names: list[Any] = [None] * self.ps.size("dp_cp")
            dist.all_gather_object(names, sorted(sums), group=self.ps.group("dp_cp"))
            for k in {k for ks in names for k in ks}:
                sums.setdefault(k, 0.0)
        metrics = reduce_train_metrics(
            sums, self.ps, global_batch_size=global_batch_size, per_token=per_token, local_num_tokens=local_tokens
        )
        metrics = self._from_last_stage(metrics)  # losses and metrics live on the last pipeline stage
        pre = self.metric_prefix
        out = {f"{pre}{k}": v for k, v in metrics.items()}
        out[f"{pre}grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out[f"{pre}update_successful"] = float(bool(ok))
        out[f"{pre}global_batch_size"] = float(global_batch_size)
        sample_tokens = sum(sum(mb["total_lengths"]) for mb in step_mbs)
        out[f"{pre}packed_tokens_ratio"] = packed_rows / sample_tokens if sample_tokens else 1.0
        if self.spec.is_moe:  # logged with or without the loss term (--moe-aux-loss-coeff)
            out[f"{pre}moe_load_balancing_loss"] = moe_load_balancing_loss(self.ps, n_mb, self.spec.num_layers)
        return out

    def _forward(self, mb: dict[str, Any]) -> tuple[torch.Tensor, PackedBatch]:
        """The training forward of one micro-batch: vocab-parallel logits here, values in the critic."""
        return self._forward_logits(mb)

    def _micro_batch_loss(
        self, mb: dict[str, Any], packed: PackedBatch, logits: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The unscaled loss R_mb of a non-empty micro-batch and its metric sums (`loss.py`)."""
        if "advantages" not in mb and self.args.loss_type == "policy_loss":
            raise ValueError(
                "no advantages: with --disable-compute-advantages-and-returns a --rollout-data-postprocess-path "
                "hook must set rollout_data['advantages']"
            )
        lp, ent, picked = self._logprobs(logits.float(), mb, packed, with_entropy=True)
        if picked is not None:  # CP: the loss sees this rank's tokens of every per-token input
            mb = {**mb, **{k: local_part(mb[k], picked) for k in self.RESPONSE_KEYS if k in mb}}
        return loss_function(self.args, mb, lp, ent, self.ps, logits=logits)

    # per-response-token inputs of the loss, whole per sample until the loss takes this rank's part (CP)
    RESPONSE_KEYS = (
        "loss_masks",
        "advantages",
        "returns",
        "log_probs",
        "ref_log_probs",
        "rollout_log_probs",
        "values",
    )

    # ---- weights --------------------------------------------------------------------------------------------
    def is_weight_sender(self) -> bool:
        """One rank per pipeline stage holds full (TP-gathered) weights: DP rank 0, TP rank 0."""
        return self.ps.rank("dp") == 0 and self.ps.rank("tp") == 0 and self.ps.rank("cp") == 0

    def weights_for_sync(self) -> Iterable[Any]:
        """What a colocated weight sync sends (`weight_buckets.Item`s): where no gather is needed (TP, EP and ETP of
        one) and the weights are on the GPU, views of the live parameters with their HF names, shapes and the
        engines' dtype, built once and kept — the parameters' storages stay the same objects through sleep and
        wake-up, so the views stay valid — which takes the conversion code off the sync's path (a `LiveWeights`:
        the sync hands their storages over in place); otherwise `export_hf()`."""
        from slime.backends.megatron.hf_weights import iter_hf_sources, layer_offset
        from slime.backends.megatron.weight_buckets import LiveWeights

        asleep = self.offloader is not None and self.offloader.asleep
        if asleep or any(self.ps.size(d) > 1 for d in ("tp", "ep", "etp")):
            return self.export_hf()
        if self._sync_sources is None:
            dtype = torch.bfloat16 if self.args.bf16 else None
            self._sync_sources = LiveWeights(
                (
                    (name, src, shape, dtype or src.dtype)
                    for chunk in self.chunks
                    for name, src, shape in iter_hf_sources(
                        unwrap_model(chunk).named_parameters(), self.spec, self.ps, layer_offset(chunk)
                    )
                ),
                hand_over=self.offloader is not None and self.offloader.enabled,  # params released after each sync
            )
        return self._sync_sources

    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of this stage (a TP collective: every TP rank must iterate), in the engines'
        dtype. While asleep (--offload-train) the device memory is paused: they come from the host copy, moved
        back to the GPU one tensor at a time (pinned, ~PCIe speed) so that conversion, buckets and the engines'
        CUDA IPC hand-off stay on the device — a host-side bucket would travel through shared memory and be
        copied to the GPU again by each engine (seconds for a 1B model instead of tens of milliseconds)."""
        dtype = torch.bfloat16 if self.args.bf16 else None
        if self.offloader is not None and self.offloader.asleep and self.offloader.host_weights is not None:
            from slime.backends.megatron.hf_weights import iter_hf_tensors, layer_offset

            named: Iterable[tuple[str, torch.Tensor]] = self.offloader.named_params_for_export(
                unwrap_model(self.model)
            )
            if torch.cuda.is_available():
                device = torch.cuda.current_device()
                named = ((n, t.to(device, non_blocking=True)) for n, t in named)
            for name, t in iter_hf_tensors(named, self.spec, self.ps, layer_offset(self.model)):
                yield name, t.to(dtype) if dtype is not None else t
            return
        yield from export_hf_weights(self.chunks, self.spec, self.ps, dtype=dtype)

    def save_hf(self, path: str) -> None:
        """`--save-hf`: an HF checkpoint `transformers` loads (config + tokenizer copied from --hf-checkpoint).

        Each pipeline stage's sender writes its own safetensors shard; rank 0 writes the index. The directory
        is written under a temporary name and renamed, so a crash never leaves a half checkpoint behind.
        """
        import json
        import os
        import shutil

        import torch.distributed as dist
        from safetensors.torch import save_file

        from slime.utils.atomic import replace_dir

        ps = self.ps
        tmp = f"{path}.tmp"
        if ps.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            for name in os.listdir(self.args.hf_checkpoint):
                if name.endswith((".json", ".txt", ".model", ".jinja")) and "safetensors.index" not in name:
                    shutil.copy(os.path.join(self.args.hf_checkpoint, name), tmp)
        dist.barrier()
        pp, pp_size = ps.rank("pp"), ps.size("pp")
        shard = f"model-{pp + 1:05d}-of-{pp_size:05d}.safetensors"
        tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in self.export_hf()}
        if self.is_weight_sender():
            save_file(tensors, os.path.join(tmp, shard), metadata={"format": "pt"})
        dist.barrier()
        if ps.global_rank == 0:
            from safetensors import safe_open

            weight_map = {}
            for k in range(pp_size):
                name = f"model-{k + 1:05d}-of-{pp_size:05d}.safetensors"
                with safe_open(os.path.join(tmp, name), "pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), name))
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
            replace_dir(tmp, path)
            logger.info("saved HF checkpoint to %s", path)
        dist.barrier()
