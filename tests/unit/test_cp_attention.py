"""Context-parallel core attention on real gloo ranks: each CP rank's output and q/k/v gradients equal the rows of
a single-rank attention over the whole packed row (packed samples, shared-prompt branches, padding), for CP=2
and CP=4 (slow), on 20 random rows each; a rank whose segment boundaries are shifted does not.

The module under test is slime's `SDPACoreAttention` with megatron's `TransformerConfig`; no model is built, so
the processes only pay for importing megatron-core.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from sim.rank_spawn import spawn_ranks
from slime.utils.http_utils import find_free_port

pytestmark = pytest.mark.cpu

HEADS, GROUPS, DIM = 4, 2, 8
CASES = 20


class _CPOnly:
    """The slice of the ParallelState protocol `shard_row_for_cp` reads: the world is the CP group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._size, self._rank = dist.get_world_size(), dist.get_rank()

    def size(self, dim: str) -> int:
        return self._size if dim == "cp" else 1

    def rank(self, dim: str) -> int:
        return self._rank if dim == "cp" else 0

    def group(self, dim: str):
        import torch.distributed as dist

        return dist.group.WORLD


def _random_row(rng: random.Random, cp: int):

    samples, prompts = [], []
    for _ in range(rng.randint(1, 5)):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 9))]
        for _ in range(rng.randint(1, 3)):  # siblings share the prompt's rows
            samples.append(prompt + [rng.randrange(50) for _ in range(rng.randint(0, 11))])
            prompts.append(len(prompt))
    return samples, prompts


def _split_a_local_segment(row) -> None:
    """Start a new segment at the first of this rank's rows that has earlier rows in its segment (its queries then
    lose their causal context on this rank only)."""
    segs = row.packed_seq_params._slime_segments
    for r in row.cp_rows.tolist():
        for k, (qs, n, p0, pl) in enumerate(segs):
            if qs < r < qs + n:
                segs[k : k + 1] = [(qs, r - qs, p0, pl), (r, qs + n - r, p0, pl)]
                return


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from slime.backends.megatron.attention import SDPACoreAttention
    from slime.backends.megatron.context_parallel import shard_row_for_cp
    from slime.backends.megatron.packing import pack_samples

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ps = _CPOnly()

    def core(cp: int) -> SDPACoreAttention:
        cfg = TransformerConfig(
            num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
            kv_channels=DIM, context_parallel_size=cp, attention_dropout=0.0, hidden_dropout=0.0,
        )  # fmt: skip
        return SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")

    single, sharded = core(1), core(world)
    rng = random.Random(11)
    errors, shifted_errors = [], []
    for case in range(CASES):
        samples, prompts = _random_row(rng, world)
        ref_row = pack_samples(samples, pad_multiple=2 * world, prompt_lengths=prompts)
        ref_row.packed_seq_params._slime_rope_applied = True  # q and k stand for post-RoPE values here
        t = ref_row.total_len
        g = torch.Generator().manual_seed(case)
        q0 = torch.randn(t, HEADS, DIM, generator=g, dtype=torch.float64)
        k0 = torch.randn(t, GROUPS, DIM, generator=g, dtype=torch.float64)
        v0 = torch.randn(t, GROUPS, DIM, generator=g, dtype=torch.float64)
        w = torch.randn(t, HEADS * DIM, generator=g, dtype=torch.float64)

        q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
        ref = single(q, k, v, None, packed_seq_params=ref_row.packed_seq_params)
        (ref * w).sum().backward()

        for shift in (False, True):
            row = pack_samples(samples, pad_multiple=2 * world, prompt_lengths=prompts)
            row.packed_seq_params._slime_rope_applied = True
            shard_row_for_cp(row, ps)
            if shift and rank == world - 1:  # the negative control: one rank's boundaries move
                _split_a_local_segment(row)
            rows = row.cp_rows
            ql, kl, vl = (x[rows].clone().requires_grad_(True) for x in (q0, k0, v0))
            out = sharded(ql, kl, vl, None, packed_seq_params=row.packed_seq_params)
            (out * w[rows]).sum().backward()
            err = max(
                float((out - ref.detach()[rows]).abs().max()),
                float((ql.grad - q.grad[rows]).abs().max()),
                float((kl.grad - k.grad[rows]).abs().max()),
                float((vl.grad - v.grad[rows]).abs().max()),
            )
            errs = torch.tensor([err], dtype=torch.float64)
            dist.all_reduce(errs, op=dist.ReduceOp.MAX)
            (shifted_errors if shift else errors).append(float(errs))
    if rank == 0:
        torch.save({"errors": errors, "shifted": shifted_errors}, os.path.join(out_dir, f"cp{world}.pt"))
    dist.destroy_process_group()


_RESULTS: dict[int, dict] = {}


def _results(cp: int, tmp_path_factory) -> dict:
    if cp not in _RESULTS:
        out = tmp_path_factory.mktemp(f"cp_attention{cp}")
        spawn_ranks(_worker, args=(cp, find_free_port(), str(out)), nprocs=cp, daemon=True)
        _RESULTS[cp] = torch.load(out / f"cp{cp}.pt")
    return _RESULTS[cp]


LAYOUTS = [2, pytest.param(4, marks=pytest.mark.slow)]  # CP=4: four processes, each importing megatron-core


@pytest.mark.parametrize("cp", LAYOUTS)
def test_cp_attention_equals_single_rank_forward_and_backward(tmp_path_factory, cp):
    errors = _results(cp, tmp_path_factory)["errors"]
    assert len(errors) == CASES
    assert max(errors) < 1e-10, errors


@pytest.mark.parametrize("cp", LAYOUTS)
def test_shifted_segment_boundaries_on_one_rank_are_caught(tmp_path_factory, cp):
    shifted = _results(cp, tmp_path_factory)["shifted"]
    assert sum(e > 1e-3 for e in shifted) >= CASES // 2, shifted
