"""PPO's critic: the actor's GPTModel with its output layer replaced by a value head, trained on the value loss.

Why the same model class: the critic reuses everything the actor's trainer does — packing, DDP, the distributed
optimizer, checkpoints, the group reducer, offload — and differs only in what it reads from the last hidden
state. `ValueHead` is `Linear(hidden, 1)` computed in fp32 (whatever the training precision), replicated on
every TP rank (the hidden state it reads is), with untied embeddings (the head replaces the LM head). Values
are never divided by a temperature. The head comes from the critic's HF checkpoint when that has one
(`score.weight` / `score.bias`, the layout of HF's `*ForTokenClassification` with one label), else it is
initialised N(0, 0.02) with zero bias, the same on every rank (its own generator, seeded by `--seed`).

One `train(rollout_id, data)` per rollout (docs/algorithms.md#ppo-and-gae): a no-grad forward gives the old
values V_old of this rank's samples; GAE with them (task reward only: the critic runs before the actor's
log-probs exist, as in slime v0.3.0) gives the returns; then the same optimizer steps as the actor's with the
clipped value loss. The old values go back to the driver, which hands them to the actor worker of the same rank.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from slime.algorithms.ppo import response_values, value_loss
from slime.algorithms.reducers import make_reducer
from slime.backends.megatron.hf_weights import HFReader, load_hf_weights
from slime.backends.megatron.initialize import run_custom_megatron_init
from slime.backends.megatron.microbatch import MicroBatch, microbatches
from slime.backends.megatron.model_provider import build_gpt_model
from slime.backends.megatron.offload import PhaseMemory
from slime.backends.megatron.packing import PackedBatch
from slime.backends.megatron.trainer import MegatronTrainer

logger = logging.getLogger(__name__)

HF_HEAD = ("score.weight", "score.bias")


class ValueHead(torch.nn.Module):
    """`Linear(hidden, 1)` in fp32 in place of GPTModel's `output_layer` (same call signature)."""

    def __init__(self, hidden_size: int, init_std: float, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=torch.float32).normal_(0, init_std, generator=gen))  # fmt: skip
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32))

    def forward(
        self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden_states.float(), self.weight, self.bias), None


class CriticTrainer(MegatronTrainer):
    metric_prefix = "critic/"

    def _build_model(self) -> Any:
        args, spec = self.args, self.spec
        model = build_gpt_model(args, spec, share_embeddings=False)
        if getattr(model, "post_process", True):
            model.output_layer = ValueHead(spec.hidden_size, model.config.init_method_std, args.seed)
        if torch.cuda.is_available():
            model = model.cuda()
        load_hf_weights(model, args.hf_checkpoint, spec, self.ps, skip_prefixes=("output_layer.",))
        reader = HFReader(args.hf_checkpoint)
        if isinstance(getattr(model, "output_layer", None), ValueHead) and HF_HEAD[0] in reader:
            with torch.no_grad():
                model.output_layer.weight.copy_(reader.get(HF_HEAD[0]).reshape(1, -1))
                if HF_HEAD[1] in reader:
                    model.output_layer.bias.copy_(reader.get(HF_HEAD[1]).reshape(1))
            logger.info("critic: value head loaded from %s", args.hf_checkpoint)
        else:
            logger.info("critic: %s has no value head (%s); initialised N(0, %.3g)", args.hf_checkpoint, HF_HEAD[0],
                        model.config.init_method_std)  # fmt: skip
        return model

    def _forward(self, mb: MicroBatch, model: Any = None) -> tuple[torch.Tensor, PackedBatch]:
        """Per-row values [T] (fp32) of the micro-batch's packed row."""
        packed = self._pack(mb)
        model = model if model is not None else self.model
        out = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
        return out[0, :, 0], packed

    def _sample_values(self, out: torch.Tensor, mb: MicroBatch, packed: PackedBatch) -> list[torch.Tensor]:
        return [response_values(out, packed.sample_rows(i, last=r + 1)) for i, r in enumerate(mb.response_lengths)]

    @torch.no_grad()
    def _old_values(self, mbs: list[MicroBatch]) -> None:
        self.pipeline.set_mode(False)
        for mb in mbs:
            mb.values = []
            if not mb.empty:
                out, packed = self._forward(mb)
                mb.values = [v.float() for v in self._sample_values(out, mb, packed)]
        self.pipeline.set_mode(True)

    def train_rollout(
        self, rollout_id: int, data: dict[str, Any], values: list[list[float]] | None = None
    ) -> tuple[dict[str, float], list[list[float]]]:
        """Old values, returns, value-loss steps. Returns (metrics, old values per sample in train-data order)."""
        run_custom_megatron_init(self.args)
        memory = PhaseMemory()
        t0 = time.perf_counter()
        mbs = microbatches(data)
        self._old_values(mbs)
        memory.end("critic_values")
        for mb in mbs:
            self._prepare_batch(mb)
        self._rank_advantages(mbs, data, kl_coef=0.0)
        t1 = time.perf_counter()
        metrics = self._run_steps(rollout_id, data, mbs)
        t2 = time.perf_counter()
        memory.end("critic_train")
        metrics.pop("_tokens")
        metrics.update(memory.metrics())
        metrics["time/critic_values"] = t1 - t0
        metrics["time/critic_train"] = t2 - t1
        old: list[list[float] | None] = [None] * len(data["tokens"])
        for mb in mbs:
            for i, v in zip(mb.indices, mb.values, strict=True):
                old[i] = v.tolist()
        return metrics, old

    def _micro_batch_loss(
        self, mb: MicroBatch, packed: PackedBatch, out: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped value loss, one token mean per group like every other loss (reducers.py)."""
        reduce = make_reducer(mb.loss_masks, mb.group_mask_sums, per_token=bool(self.args.calculate_per_token_loss))
        values = torch.cat(self._sample_values(out, mb, packed))
        old = torch.cat(mb.values).to(values.device)
        returns = torch.cat(mb.returns).to(values.device)
        loss_t, clip_t = value_loss(values, old, returns, float(self.args.value_clip))
        loss = reduce(loss_t) + out.sum() * 0.0  # every row stays in the graph, as on an empty rank
        metrics = {
            "value_loss": loss.detach().clone(),
            "value_clipfrac": reduce(clip_t),
            "values": reduce(values.detach()),
            "returns": reduce(returns),
        }
        return loss, metrics
