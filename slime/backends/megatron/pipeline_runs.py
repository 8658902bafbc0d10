"""The trainer's model chunks and megatron's pipeline schedules: what `MegatronTrainer` inherits to run one
model split over pipeline stages, with or without virtual stages (docs/megatron_contract.md#pipeline-parallelism).

Why a base class of its own: every pass of the trainer (the π_old / π_ref log-probs, the optimizer steps) goes
through `_run_schedule`, and which chunk ends the model, how rows are padded for the interleaved schedule and
how the last stage's results reach the others are one concern, apart from the RL step itself (trainer.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from slime.backends.megatron.hf_weights import load_hf_weights, unwrap_model
from slime.backends.megatron.model_provider import build_gpt_model
from slime.backends.megatron.packing import PackedBatch

logger = logging.getLogger(__name__)


def current_device() -> torch.device:
    """Where this rank's tensors live: its CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class ModelChunks:
    """Model chunks (`self.chunks`) and the pipeline runs over them; the trainer provides `args`, `spec`, `ps`,
    `_pack`, `_forward`, `_forward_logits`, `_batch_logprobs`, `_build_model` and `_pad_to`."""

    chunks: list[Any]

    def _build_models(self) -> list[Any]:
        """This rank's model chunks: one, or one per virtual pipeline stage (each its own layers)."""
        vpp = self.args.virtual_pipeline_model_parallel_size or 1
        if vpp == 1:
            return [self._build_model()]
        models = [build_gpt_model(self.args, self.spec, vp_stage=i) for i in range(vpp)]
        if torch.cuda.is_available():
            models = [m.cuda() for m in models]
        load_hf_weights(models, self.args.hf_checkpoint, self.spec, self.ps)
        return models

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter of the rank's chunks; names carry the chunk index when there are several."""
        for i, chunk in enumerate(self.chunks):
            for n, p in unwrap_model(chunk).named_parameters():
                yield (n if len(self.chunks) == 1 else f"chunk{i}.{n}"), p

    def _set_mode(self, train: bool) -> None:
        for chunk in self.chunks:
            chunk.train(train)

    def _pipelined_logprobs(self, batches: list[tuple[dict[str, Any], list[tuple[int, int]]]], mbs, key: str) -> None:
        """PP > 1: the log-prob pass through megatron's forward-only pipeline schedule. The last stage scores the
        batches; their log-probs are then broadcast to the other stages (which compute advantages too)."""
        if not batches:
            return
        if len(self.chunks) > 1:
            # the interleaved schedule runs micro-batches in groups of `microbatch_group_size_per_vp_stage`:
            # pad with empty batches (one dummy token each, scored as nothing)
            group = self.chunks[0].config.microbatch_group_size_per_vp_stage
            empty = {"tokens": [], "total_lengths": [], "response_lengths": []}
            batches = batches + [(dict(empty), [])] * (-len(batches) % group)
        last = self.is_last_stage()
        scored: list[list[torch.Tensor]] = []

        def forward_step(it: Iterator[dict[str, Any]], model: Any):
            batch = next(it)
            out, packed = self._stage_forward(batch, model)

            def loss_func(output: torch.Tensor):  # runs on the last stage only
                scored.append(self._batch_logprobs(output, batch, packed) if batch["tokens"] else [])
                return output.sum() * 0.0, torch.tensor(1, dtype=torch.int), {}

            return out, loss_func

        self._run_schedule(forward_step, [b for b, _ in batches], forward_only=True)
        sizes = [sum(b["response_lengths"]) for b, _ in batches]
        flat = torch.zeros(sum(sizes), dtype=torch.float32, device=current_device())
        if last:
            flat.copy_(torch.cat([torch.cat(lp) if lp else flat.new_zeros(0) for lp in scored]))
        self.ps.broadcast(flat, src=self.ps.size("pp") - 1, dim="pp")
        for (batch, targets), part in zip(batches, flat.split(sizes), strict=True):
            for (j, p), x in zip(targets, part.split(list(batch["response_lengths"])), strict=True):
                mbs[j][key][p] = x

    def _from_last_stage(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last stage's step metrics on every stage (only it runs the loss and the reducers)."""
        if self.ps.size("pp") == 1:
            return metrics
        import torch.distributed as dist

        box = [metrics]
        last = dist.get_global_rank(self.ps.group("pp"), self.ps.size("pp") - 1)
        dist.broadcast_object_list(box, src=last, group=self.ps.group("pp"))
        return box[0]

    def is_last_stage(self) -> bool:
        return self.ps.rank("pp") == self.ps.size("pp") - 1

    def _run_schedule(self, forward_step: Any, items: list[dict[str, Any]], forward_only: bool) -> None:
        """megatron's schedule (no pipelining, 1F1B, or interleaved for virtual stages) over `items`.

        Interleaved: one iterator per chunk (each virtual stage runs every micro-batch) and every row padded to
        the run's longest, whose length is the schedule's fixed p2p shape."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        seq_length = 1
        if len(self.chunks) > 1:
            seq_length = self._pad_to = max(self._pack(mb).total_len for mb in items)
        try:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(items) if len(self.chunks) == 1 else [iter(items) for _ in self.chunks],
                model=self.chunks,
                num_microbatches=len(items),
                seq_length=seq_length,
                micro_batch_size=1,
                forward_only=forward_only,
            )
        finally:
            self._pad_to = None

    def _stage_forward(self, mb: dict[str, Any], model: Any) -> tuple[torch.Tensor, PackedBatch]:
        """One model chunk's forward of one micro-batch: the training head's output on the chunk that ends the
        model (`_forward`: logits here, values in the critic), else the hidden states megatron's schedule sends
        on to the next stage (this chunk's input came from the one before)."""
        if unwrap_model(model).post_process:
            return self._forward(mb) if len(self.chunks) == 1 else self._forward_logits(mb, model)
        packed = self._pack(mb)
        tokens, positions = packed.model_inputs()
        return model(tokens, positions, None, packed_seq_params=packed.packed_seq_params), packed
