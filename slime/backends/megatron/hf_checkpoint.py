"""`--save-hf`: a trainer's weights written as an HF checkpoint `transformers` loads (config and tokenizer copied
from --hf-checkpoint).

Each pipeline stage's sender writes its own safetensors shard; rank 0 writes the index. The directory is written
under a temporary name and renamed, so a crash never leaves a half checkpoint behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable

import torch
import torch.distributed as dist

from slime.parallel_state import ParallelState
from slime.utils.atomic import replace_dir

logger = logging.getLogger(__name__)


def write_hf_checkpoint(
    path: str, hf_checkpoint: str, ps: ParallelState, named: Iterable[tuple[str, torch.Tensor]], sender: bool
) -> None:
    """A collective of every train rank: `named` is this stage's export (every rank iterates it: TP gathers),
    written by the stage's `sender`."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp"
    if ps.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for name in os.listdir(hf_checkpoint):
            if name.endswith((".json", ".txt", ".model", ".jinja")) and "safetensors.index" not in name:
                shutil.copy(os.path.join(hf_checkpoint, name), tmp)
    dist.barrier()
    pp, pp_size = ps.rank("pp"), ps.size("pp")
    shard = f"model-{pp + 1:05d}-of-{pp_size:05d}.safetensors"
    tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in named}
    if sender:
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
