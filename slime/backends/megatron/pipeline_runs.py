"""`PipelineRunner`: megatron's pipeline schedules over one rank's model chunks.

(docs/megatron_contract.md#pipeline-parallelism)

Every pass of the trainer (the π_old / π_ref log-probs, the optimizer steps) goes through `run`. Which chunk
ends the model, how rows are padded for the interleaved (virtual pipeline) schedule and how the last stage's
results reach the others are one concern, apart from the RL step (trainer.py). The runner is given what it
needs: the chunks, the parallel state, `pack` (a micro-batch as one THD row, `pad_to` tokens long when set) and
`head` (the forward of the chunk that ends the model: logits in the actor, values in the critic).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from slime.backends.megatron.hf_weights import unwrap_model
from slime.backends.megatron.microbatch import MicroBatch
from slime.backends.megatron.packing import PackedBatch
from slime.parallel_state import ParallelState

logger = logging.getLogger(__name__)

Pack = Callable[[MicroBatch], PackedBatch]
Head = Callable[[MicroBatch, Any], tuple[torch.Tensor, PackedBatch]]
Score = Callable[[torch.Tensor, MicroBatch, PackedBatch], list[torch.Tensor]]


def current_device() -> torch.device:
    """Where this rank's tensors live: its CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class PipelineRunner:
    def __init__(self, chunks: list[Any], ps: ParallelState, pack: Pack, head: Head) -> None:
        self.chunks = chunks
        self.ps = ps
        self.pack = pack
        self.head = head
        # the interleaved schedule's fixed row length during one run (its p2p exchanges have one shape); else None
        self.pad_to: int | None = None

    def set_mode(self, train: bool) -> None:
        for chunk in self.chunks:
            chunk.train(train)

    def is_last_stage(self) -> bool:
        return self.ps.rank("pp") == self.ps.size("pp") - 1

    def run(self, forward_step: Any, items: list[MicroBatch], forward_only: bool) -> None:
        """megatron's schedule (no pipelining, 1F1B, or interleaved for virtual stages) over `items`.

        Interleaved: one iterator per chunk (each virtual stage runs every micro-batch) and every row padded to
        the run's longest, whose length is the schedule's fixed p2p shape."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        seq_length = 1
        if len(self.chunks) > 1:
            seq_length = self.pad_to = max(self.pack(mb).total_len for mb in items)
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
            self.pad_to = None

    def stage_forward(self, mb: MicroBatch, model: Any) -> tuple[torch.Tensor, PackedBatch]:
        """One model chunk's forward of one micro-batch: the head's output on the chunk that ends the model, else
        the hidden states megatron's schedule sends on to the next stage (this chunk's input came from the one
        before)."""
        if unwrap_model(model).post_process:
            return self.head(mb, model)
        packed = self.pack(mb)
        tokens, positions = packed.model_inputs()
        return model(tokens, positions, None, packed_seq_params=packed.packed_seq_params), packed

    def score(self, batches: list[MicroBatch], score: Score) -> list[list[torch.Tensor]]:
        """PP > 1: a no-grad pass through megatron's forward-only schedule; the last stage scores each batch
        (per-sample response tensors), and every stage gets them back (the others compute advantages too)."""
        if not batches:
            return []
        run = batches
        if len(self.chunks) > 1:
            # the interleaved schedule runs micro-batches in groups of `microbatch_group_size_per_vp_stage`:
            # pad with empty batches (one dummy token each, scored as nothing)
            group = self.chunks[0].config.microbatch_group_size_per_vp_stage
            run = batches + [MicroBatch([], [], []) for _ in range(-len(batches) % group)]
        scored: list[list[torch.Tensor]] = []

        def forward_step(it: Iterator[MicroBatch], model: Any):
            batch = next(it)
            out, packed = self.stage_forward(batch, model)

            def loss_func(output: torch.Tensor):  # runs on the last stage only
                scored.append(score(output, batch, packed) if not batch.empty else [])
                return output.sum() * 0.0, torch.tensor(1, dtype=torch.int), {}

            return out, loss_func

        self.run(forward_step, run, forward_only=True)
        sizes = [sum(b.response_lengths) for b in run]
        flat = torch.zeros(sum(sizes), dtype=torch.float32, device=current_device())
        if self.is_last_stage():
            flat.copy_(torch.cat([torch.cat(lp) if lp else flat.new_zeros(0) for lp in scored]))
        self.ps.broadcast(flat, src=self.ps.size("pp") - 1, dim="pp")
        parts = flat.split(sizes)[: len(batches)]  # the padding batches score nothing
        return [list(part.split(list(b.response_lengths))) for b, part in zip(batches, parts, strict=True)]

    def from_last_stage(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last stage's step metrics on every stage (only it runs the loss and the reducers)."""
        if self.ps.size("pp") == 1:
            return metrics
        import torch.distributed as dist

        box = [metrics]
        last = dist.get_global_rank(self.ps.group("pp"), self.ps.size("pp") - 1)
        dist.broadcast_object_list(box, src=last, group=self.ps.group("pp"))
        return box[0]
