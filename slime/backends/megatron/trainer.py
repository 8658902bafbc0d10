"""`MegatronTrainer`: one training rank — megatron-core model, DDP, optimizer, LR schedule, the RL train step.

One `train(rollout_id, data)` call consumes this rank's share of a rollout (built on the rollout side by
`slime/scheduling`), as `MicroBatch`es (microbatch.py): π_old (and the frozen models' — reference, teacher —)
log-probs are recomputed with the same micro-batches, advantages are computed, then every optimizer step runs
megatron's forward-backward schedule (`PipelineRunner`, pipeline_runs.py) over its micro-batches with the group
normaliser of `slime/algorithms/reducers.py`. A partial last step of b < B groups divides its loss by b and
advances the LR schedule by b. The set-up is the named steps of trainer_setup.py.
"""

from __future__ import annotations

import logging
import time
from argparse import Namespace
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from typing import Any

import torch

from slime.algorithms.advantages import compute_advantages_and_returns, distributed_masked_whiten, opd_inputs
from slime.algorithms.logprobs import packed_response_logprobs_and_entropy, score_rows
from slime.algorithms.loss import loss_function
from slime.algorithms.opd import apply_opd
from slime.algorithms.ppo import ppo_advantages
from slime.algorithms.reducers import reduce_train_metrics, scale_for_megatron
from slime.backends.megatron import trainer_setup as setup
from slime.backends.megatron.context_parallel import (
    gather_responses,
    local_part,
    local_response_rows,
    shard_row_for_cp,
    whole_sample_state,
)
from slime.backends.megatron.hf_checkpoint import write_hf_checkpoint
from slime.backends.megatron.hf_config import read_hf_config
from slime.backends.megatron.hf_weights import export_hf_weights, load_hf_weights
from slime.backends.megatron.initialize import init_distributed, init_megatron, run_custom_megatron_init
from slime.backends.megatron.microbatch import (
    RESPONSE_FIELDS,
    MicroBatch,
    flat_fields,
    logprob_batches,
    microbatches,
    rollout_data_view,
    write_back,
)
from slime.backends.megatron.model_provider import (
    build_gpt_model,
    clear_moe_tracker,
    mask_padded_vocab,
    moe_load_balancing_loss,
)
from slime.backends.megatron.offload import PhaseMemory, no_region
from slime.backends.megatron.packing import PackedBatch, pack_samples, row_pad_multiple
from slime.backends.megatron.pipeline_runs import PipelineRunner, current_device
from slime.backends.megatron.sync_sources import export_from_host, live_weights

logger = logging.getLogger(__name__)

# what the advantage estimators (and --custom-advantage-function-path) receive of a micro-batch, as in slime
ADVANTAGE_INPUTS = ("rewards", "loss_masks", "response_lengths", "total_lengths", "log_probs", "ref_log_probs",
                    "teacher_log_probs", "rollout_log_probs", "values")  # fmt: skip
# the frozen models the actor scores against: (their weights in `frozen`, the field they fill, the hook's prefix)
FROZEN_PASSES = (("ref", "ref_log_probs", "ref_"), ("teacher", "teacher_log_probs", "teacher_"))
# GAE's inputs over all of a rank's samples (PPO)
GAE_INPUTS = ("rewards", "loss_masks", "total_lengths", "response_lengths", "values", "log_probs", "ref_log_probs",
              "rollout_log_probs", "teacher_log_probs")  # fmt: skip


class MegatronTrainer:
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
        self.args = args
        self.offloader = offloader  # offload.py, set up by the backend; None: never asleep
        region = offloader.region if offloader is not None else no_region
        init_distributed(args, rank, world_size, master_addr, master_port, node_ip=node_ip, listen=listen)
        self.ps = init_megatron(args)
        self.spec = read_hf_config(args.hf_checkpoint)
        with region("model"):  # the model and its DDP param/grad buffers
            models = setup.build_models(args, self.spec, self.ps, self._build_model)
            self.chunks = setup.wrap_in_ddp(args, models)
        # the rank's model when it is one chunk (everything but virtual pipeline stages); None otherwise, so that
        # code written for one chunk fails loudly instead of seeing part of the model
        self.model = self.chunks[0] if len(self.chunks) == 1 else None
        with region("optimizer"):  # fp32 master params and Adam's moments
            allocate = offloader is not None and offloader.enabled
            self.optimizer = setup.build_optimizer(args, self.chunks, allocate_state=allocate)
        self.scheduler = setup.build_scheduler(args, self.optimizer)
        self.frozen = setup.frozen_weights(args, models, self.chunks, self.spec, self.ps)
        self._hooks = setup.load_hooks(args)
        # late-bound: an override of `_pack` / `_forward` (the critic's, a test's) is what the schedules run
        self.pipeline = PipelineRunner(
            self.chunks, self.ps, pack=lambda mb: self._pack(mb), head=lambda mb, model: self._forward(mb, model)
        )
        sp = self.ps.size("tp") if args.sequence_parallel else 1
        self.pad_multiple = row_pad_multiple(args.data_pad_size_multiplier, self.ps.size("cp"), sp)
        self._sync_sources: list[Any] | None = None  # weights_for_sync's views, built at the first sync
        self.train_step_id = 0

    @property
    def ref_params(self) -> dict[str, torch.Tensor] | None:
        """The reference policy's weights on the host, None when the rollout side serves it (or no KL needs it)."""
        return self.frozen.get("ref")

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return setup.named_parameters(self.chunks)

    def _build_model(self) -> Any:
        """This rank's GPTModel with the HF checkpoint's weights (the critic replaces it: critic.py)."""
        model = build_gpt_model(self.args, self.spec)
        if torch.cuda.is_available():
            model = model.cuda()
        load_hf_weights(model, self.args.hf_checkpoint, self.spec, self.ps)
        return model

    # ---- forward helpers ------------------------------------------------------------------------------------
    def _forward_logits(
        self, mb: MicroBatch | Mapping[str, Any], model: Any = None
    ) -> tuple[torch.Tensor, PackedBatch]:
        """Vocab-parallel logits of one micro-batch; `{"tokens": rows}` runs bare rows (tools and tests do)."""
        if isinstance(mb, Mapping):
            mb = MicroBatch.rows(mb["tokens"])
        packed = self._pack(mb)
        tokens, positions = packed.model_inputs()
        model = model if model is not None else self.model
        logits = model(tokens, positions, None, packed_seq_params=packed.packed_seq_params)
        return mask_padded_vocab(logits[0], self.spec.vocab_size, self.ps.rank("tp")), packed

    def _forward(self, mb: MicroBatch, model: Any = None) -> tuple[torch.Tensor, PackedBatch]:
        """The training head's forward of one micro-batch: vocab-parallel logits here, values in the critic."""
        return self._forward_logits(mb, model)

    def _pack(self, mb: MicroBatch) -> PackedBatch:
        """The micro-batch as one THD row (an empty micro-batch runs one dummy token, to join the schedule)."""
        prompts = None
        if self.args.share_prompt_prefix and not mb.empty and mb.response_lengths is not None:
            prompts = [t - r for t, r in zip(mb.total_lengths, mb.response_lengths, strict=True)]
        packed = pack_samples(
            mb.tokens or [[0]],
            pad_multiple=self.pad_multiple,
            device=current_device(),
            prompt_lengths=prompts,
            pad_to=self.pipeline.pad_to,
        )
        if not mb.empty and packed.lengths != list(mb.total_lengths):
            raise ValueError(f"micro-batch token counts {packed.lengths} differ from total_lengths")
        if self.ps.size("cp") > 1:
            shard_row_for_cp(packed, self.ps)
        return packed

    def _logprobs(
        self, logits: torch.Tensor, mb: MicroBatch, packed: PackedBatch, with_entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """(log-probs, entropies, picked) of the response tokens this rank scores. `picked` is None when they
        are whole responses; with CP, each sample's response indices scored here (context_parallel.py)."""
        common = {
            "temperature": self.args.rollout_temperature,
            "vocab_start": self.ps.rank("tp") * logits.size(-1),
            "with_entropy": with_entropy,
            "chunk_size": self.args.log_probs_chunk_size,
        }
        if packed.cp_rows is not None:
            pred, target_rows, picked = local_response_rows(packed, mb.response_lengths)
            targets = packed.tokens.reshape(-1).index_select(0, target_rows)
            lp, ent = score_rows(logits, pred, targets, [int(js.numel()) for js in picked], self.ps, **common)
            return lp, ent, picked
        # the rows of each response and of the token before it: all the reader scores
        rows = [packed.sample_rows(i, last=r + 1) for i, r in enumerate(mb.response_lengths)]
        lp, ent = packed_response_logprobs_and_entropy(
            logits, packed.tokens, rows, mb.response_lengths, self.ps, **common
        )
        return lp, ent, None

    # ---- log-prob passes ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _compute_logprobs(self, mbs: list[MicroBatch], field: str, store_prefix: str = "") -> None:
        """Fill each micro-batch's `field` with per-sample response log-probs of the current weights (no grad)."""
        if "before_log_prob" in self._hooks:
            self._hooks["before_log_prob"](self.args, self.chunks, store_prefix)
        self.pipeline.set_mode(False)
        for mb in mbs:
            setattr(mb, field, [None] * len(mb))
        batches = [(b, t) for b, t in logprob_batches(mbs, self.args.log_probs_max_tokens_per_gpu) if not b.empty]
        if self.ps.size("ep") > 1:  # MoE: the token all-to-all is an EP collective, so every EP rank runs as many
            batches += [(MicroBatch([], [], []), []) for _ in range(self._ep_padding(len(batches)))]  # forwards
        if self.ps.size("pp") > 1:
            scored = self.pipeline.score([b for b, _ in batches], self._batch_logprobs)
        else:
            scored = []
            for batch, _ in batches:
                logits, packed = self._forward_logits(batch)
                scored.append([] if batch.empty else self._batch_logprobs(logits, batch, packed))
        for (_, targets), lps in zip(batches, scored, strict=True):
            for (j, p), x in zip(targets, lps, strict=True):
                getattr(mbs[j], field)[p] = x  # computed under no_grad: nothing to detach
        self.pipeline.set_mode(True)

    def _ep_padding(self, count: int) -> int:
        """How many empty forwards this rank adds so that its EP group runs the same number."""
        most = self.ps.all_reduce(torch.tensor([count], dtype=torch.float64), "max", "ep")
        return int(most.item()) - count

    def _batch_logprobs(self, logits: torch.Tensor, batch: MicroBatch, packed: PackedBatch) -> list[torch.Tensor]:
        """Whole per-sample response log-probs of one batch's logits (under CP gathered back in sample order)."""
        lp, _, picked = self._logprobs(logits.float(), batch, packed, with_entropy=False)
        if picked is not None:  # CP: whole responses, in sample order, on every CP rank
            lp = gather_responses(lp, picked, batch.response_lengths, self.ps)
        return lp

    @torch.no_grad()
    def _swap_params(self, source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        saved = {}
        for n, p in self.named_parameters():
            saved[n] = p.detach().to("cpu", copy=True)
            p.copy_(source[n].to(p.device))
        return saved

    def _old_logprobs(self, data: dict[str, Any], mbs: list[MicroBatch]) -> bool:
        """π_old, then the frozen models' log-probs; returns whether π_old was recomputed."""
        args = self.args
        # sft_loss reads only the live forward's log-probs, so the old-policy pass would be a wasted forward.
        needs_old = args.loss_type != "sft_loss"
        recompute = needs_old and (not args.use_rollout_logprobs or args.get_mismatch_metrics)
        if recompute:
            self._compute_logprobs(mbs, "log_probs")
        elif needs_old and "rollout_log_probs" in data:
            dev = current_device()
            for mb in mbs:
                mb.log_probs = [torch.tensor(x, dtype=torch.float32, device=dev) for x in mb.rollout_log_probs]
        for name, field, prefix in FROZEN_PASSES:
            if name in self.frozen:
                actor = self._swap_params(self.frozen[name])
                self._compute_logprobs(mbs, field, store_prefix=prefix)
                self._swap_params(actor)
        return recompute

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
        mbs = microbatches(data)
        ppo = args.advantage_estimator == "ppo"
        if ppo:
            if values is None:
                raise ValueError("--advantage-estimator ppo: the actor needs the critic's values")
            for mb in mbs:
                mb.values = [torch.tensor(values[i], dtype=torch.float32, device=current_device()) for i in mb.indices]
        recompute = self._old_logprobs(data, mbs)
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
        if "ref" in self.frozen and args.ref_update_interval and (rollout_id + 1) % args.ref_update_interval == 0:
            # --ref-update-interval: the reference policy becomes the current actor
            self.frozen["ref"] = {n: p.detach().to("cpu", copy=True) for n, p in self.named_parameters()}
        return metrics

    def _run_steps(self, rollout_id: int, data: dict[str, Any], mbs: list[MicroBatch]) -> dict[str, float]:
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
            num_tokens += sum(sum(mb.total_lengths) for mb in step_mbs)
            for k, v in step_metrics.items():
                metrics[k] = metrics.get(k, 0.0) + v / len(data["num_microbatches"])
        metrics["_tokens"] = float(num_tokens)
        metrics[f"{pre}samples"] = float(sum(len(mb) for mb in mbs))
        metrics[f"{pre}steps"] = float(len(data["num_microbatches"]))
        metrics[f"{pre}lr"] = float(self.optimizer.param_groups[0]["lr"])
        return metrics

    def _max_rollout_logprob_diff(self, mbs: list[MicroBatch]) -> float:
        """max |ℓ_recomputed − ℓ_engine| over loss-masked response tokens of every rank (0 when there are none)."""
        m = torch.zeros((), dtype=torch.float64, device=current_device())
        for mb in mbs:
            if len(mb.log_probs or []) != len(mb.rollout_log_probs):
                raise ValueError("recomputed and rollout log-probs cover different samples")
            if not mb.rollout_log_probs:
                continue
            lp = torch.cat(mb.log_probs).to(torch.float64)
            roll = torch.cat(mb.rollout_log_probs).to(lp.device, torch.float64)
            mask = torch.cat(mb.loss_masks).to(lp.device) > 0
            if lp.numel():
                m = torch.maximum(m, ((lp - roll).abs() * mask).max())
        return float(self.ps.all_reduce(m, "max", "dp_cp"))

    def _prepare_batch(self, mb: MicroBatch) -> None:
        """Turn one micro-batch's lists into the tensors `loss_function` expects (CP=1: responses whole)."""
        dev = current_device()
        mb.loss_masks = [torch.tensor(m, dtype=torch.float32, device=dev) for m in mb.loss_masks]
        for field in ("rollout_log_probs", "teacher_log_probs", "ref_log_probs"):  # lists from the rollout side
            if getattr(mb, field) is not None:
                setattr(mb, field, [torch.as_tensor(x, dtype=torch.float32, device=dev) for x in getattr(mb, field)])
        ppo_builtin = self.args.advantage_estimator == "ppo" and not self.args.custom_advantage_function_path
        if mb.empty:
            mb.advantages, mb.returns = [], []
        elif not self.args.disable_compute_advantages_and_returns and not ppo_builtin:
            batch = {k: v for k, v in mb.batch().items() if k in ADVANTAGE_INPUTS}
            # whole samples here, also under CP (the CP ranks of a DP rank hold the same ones)
            compute_advantages_and_returns(self.args, batch, whole_sample_state(self.ps))
            mb.advantages, mb.returns = batch["advantages"], batch["returns"]

    def _rank_advantages(self, mbs: list[MicroBatch], data: dict[str, Any], kl_coef: float | None = None) -> None:
        """PPO: GAE over all of this rank's samples at once (a fan-out group's segments are chained, over DP
        too), written back into each micro-batch's `advantages` / `returns`."""
        flat = flat_fields(mbs, GAE_INPUTS)
        for key in ("batch_positions", "next_segments"):
            flat[key] = [data[key][i] for mb in mbs for i in mb.indices]
        adv, ret = ppo_advantages(self.args, flat, self.ps, kl_coef=kl_coef)
        if self.args.use_opd:
            adv = apply_opd(adv, *opd_inputs(self.args, flat), self.args.opd_kl_coef)
        if self.args.normalize_advantages:
            adv = distributed_masked_whiten(adv, [torch.as_tensor(m) for m in flat.get("loss_masks", [])], self.ps)
        start = 0
        for mb in mbs:
            mb.advantages, mb.returns = adv[start : start + len(mb)], ret[start : start + len(mb)]
            start += len(mb)

    def _postprocess(self, rollout_id: int, data: dict[str, Any], mbs: list[MicroBatch]) -> None:
        """`--rollout-data-postprocess-path(args, rollout_id, rollout_data)`: this rank's samples as lists in
        train-data order (slime's signature), after log-probs and advantages; what it writes back is trained on.
        Group denominators stay those of the rollout-side loss masks."""
        view = rollout_data_view(data, mbs)
        self._hooks["postprocess"](self.args, rollout_id, view)
        write_back(view, mbs, len(data["tokens"]))

    def _optimizer_step(self, step_mbs: list[MicroBatch], global_batch_size: int) -> dict[str, float]:
        args = self.args
        per_token = args.calculate_per_token_loss
        sums: dict[str, float] = {}
        local_tokens = 0.0
        packed_rows = 0  # tokens the model actually ran on (fewer than the samples' with shared prompts)
        n_mb = len(step_mbs)

        def loss_func(mb: MicroBatch, packed: PackedBatch, logits: torch.Tensor):
            nonlocal local_tokens
            if mb.empty:
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
                sample_token_counts=[int(sum(x.tolist())) for x in mb.loss_masks] if per_token else None,
            )
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            local_tokens += float(num_tokens)
            return scaled, num_tokens, {}

        def forward_step(it: Iterator[MicroBatch], model: Any):
            nonlocal packed_rows
            mb = next(it)
            logits, packed = self.pipeline.stage_forward(mb, model)
            packed_rows += 0 if mb.empty else packed.total_len - packed.pad
            return logits, partial(loss_func, mb, packed)

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.spec.is_moe:
            clear_moe_tracker()
        self.pipeline.run(forward_step, step_mbs, forward_only=False)
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
        metrics = self.pipeline.from_last_stage(metrics)  # losses and metrics live on the last pipeline stage
        pre = self.metric_prefix
        out = {f"{pre}{k}": v for k, v in metrics.items()}
        out[f"{pre}grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out[f"{pre}update_successful"] = float(bool(ok))
        out[f"{pre}global_batch_size"] = float(global_batch_size)
        sample_tokens = sum(sum(mb.total_lengths) for mb in step_mbs)
        out[f"{pre}packed_tokens_ratio"] = packed_rows / sample_tokens if sample_tokens else 1.0
        if self.spec.is_moe:  # logged with or without the loss term (--moe-aux-loss-coeff)
            out[f"{pre}moe_load_balancing_loss"] = moe_load_balancing_loss(self.ps, n_mb, self.spec.num_layers)
        return out

    def _micro_batch_loss(
        self, mb: MicroBatch, packed: PackedBatch, logits: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The unscaled loss R_mb of a non-empty micro-batch and its metric sums (`loss.py`)."""
        if mb.advantages is None and self.args.loss_type == "policy_loss":
            raise ValueError(
                "no advantages: with --disable-compute-advantages-and-returns a --rollout-data-postprocess-path "
                "hook must set rollout_data['advantages']"
            )
        lp, ent, picked = self._logprobs(logits.float(), mb, packed, with_entropy=True)
        batch = mb.batch()
        if picked is not None:  # CP: the loss sees this rank's tokens of every per-token input
            batch.update({k: local_part(batch[k], picked) for k in RESPONSE_FIELDS if k in batch})
        return loss_function(self.args, batch, lp, ent, self.ps, logits=logits)

    # ---- weights --------------------------------------------------------------------------------------------
    def is_weight_sender(self) -> bool:
        """One rank per pipeline stage holds full (TP-gathered) weights: DP rank 0, TP rank 0."""
        return self.ps.rank("dp") == 0 and self.ps.rank("tp") == 0 and self.ps.rank("cp") == 0

    def weights_for_sync(self) -> Iterable[Any]:
        """What a colocated weight sync sends (`weight_buckets.Item`s): where no gather is needed (TP, EP and ETP of
        one) and the weights are on the GPU, views of the live parameters, built at the first sync and kept (the
        parameters' storages stay the same objects through sleep and wake-up, so the views stay valid:
        sync_sources.py); otherwise `export_hf()`."""
        asleep = self.offloader is not None and self.offloader.asleep
        if asleep or any(self.ps.size(d) > 1 for d in ("tp", "ep", "etp")):
            return self.export_hf()
        if self._sync_sources is None:
            hand_over = self.offloader is not None and self.offloader.enabled  # params released after each sync
            self._sync_sources = live_weights(self.chunks, self.spec, self.ps, self._engine_dtype(), hand_over)
        return self._sync_sources

    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of this stage (a TP collective: every TP rank must iterate), in the engines'
        dtype; while asleep (--offload-train), from the host copy (sync_sources.py)."""
        if self.offloader is not None and self.offloader.asleep and self.offloader.host_weights is not None:
            return export_from_host(self.offloader, self.model, self.spec, self.ps, self._engine_dtype())
        return export_hf_weights(self.chunks, self.spec, self.ps, dtype=self._engine_dtype())

    def _engine_dtype(self) -> torch.dtype | None:
        """What the engines serve: bf16 with --bf16, else the trainer's own dtype (None: as it is)."""
        return torch.bfloat16 if self.args.bf16 else None

    def save_hf(self, path: str) -> None:
        """`--save-hf`: this stage's weights into an HF checkpoint at `path` (hf_checkpoint.py)."""
        write_hf_checkpoint(path, self.args.hf_checkpoint, self.ps, self.export_hf(), self.is_weight_sender())
