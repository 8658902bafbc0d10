"""What the GPU benches share: a random-init Qwen2-shaped checkpoint built on the GPU, and one colocated
`MegatronTrainer` rank (bf16, `--offload-train`) that has taken a train step, so its Adam state exists.

Not a bench itself. `bench/gpu_weight_sync.py` and `bench/gpu_offload.py` build the trainer exactly as
`TrainRayActor.init` does (the offloader's memory regions included), without Ray, so their numbers are those of
the production code path and nothing else.
"""

from __future__ import annotations

import datetime
import json
import random
import shutil
from pathlib import Path
from typing import Any

# Qwen2-shaped models: hidden, layers, heads, kv heads, ffn, vocab (None: the tiny tokenizer's), tied embeddings
SHAPES: dict[str, tuple[int, int, int, int, int, int | None, bool]] = {
    "1.8B": (2048, 24, 16, 16, 5504, 151936, False),  # the MFU bench's shape; 3.7 GB of bf16 weights
    "1.2B": (2048, 24, 16, 16, 5504, None, True),  # the colocated step measured in docs/performance.md
    "0.5B": (1024, 24, 16, 16, 2816, 151936, False),
    "tiny": (256, 4, 8, 4, 1024, None, True),  # for a dry run of the benches themselves
}


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def build_checkpoint(
    work: Path,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int | None = None,
    tied: bool = True,
) -> Path:
    """The tiny checkpoint's tokenizer with a random Qwen2 of this shape (bf16, initialised on the GPU).

    Cached under `work` (a `DONE` marker): the benches of one GPU session build it once."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sim.tiny_checkpoint import build_tiny_checkpoint

    out = work / "model"
    if (out / "DONE").is_file():
        return out
    tok = build_tiny_checkpoint(work / "tok")
    cfg = Qwen2Config.from_pretrained(tok)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = hidden, ffn, layers
    cfg.num_attention_heads, cfg.num_key_value_heads = heads, kv_heads
    cfg.tie_word_embeddings = tied
    if vocab is not None:
        cfg.vocab_size = vocab  # larger than the tokenizer's: ids past it are never generated
    if getattr(cfg, "layer_types", None) is not None:  # one entry per layer (newer transformers): resize with them
        cfg.layer_types = [cfg.layer_types[0]] * cfg.num_hidden_layers
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    for f in tok.iterdir():
        if f.is_file() and not f.name.startswith(("model", "config")) and f.suffix in (".json", ".txt", ".jinja"):
            shutil.copy(f, out / f.name)
    (out / "DONE").write_text("ok")
    return out


def checkpoint_for(work: Path, shape: str) -> Path:
    hidden, layers, heads, kv, ffn, vocab, tied = SHAPES[shape]
    return build_checkpoint(work / shape, hidden, layers, heads, kv, ffn, vocab, tied)


def colocated_trainer(
    ckpt: Path, port: int, *, samples: int = 8, tokens: int = 512, extra: tuple[str, ...] = ("--bf16",)
) -> tuple[Any, Any, Any]:
    """(args, trainer, offloader) of one colocated bf16 rank after one train step, awake.

    Built as `TrainRayActor.init` builds it (`--colocate` turns `--offload-train` on); the step's samples are
    random tokens, `samples` of `tokens` each, so the optimizer state exists and the weights differ from the
    checkpoint's (a weight sync then has something to move). `extra`: more flags (a CPU dry run passes the CPU
    shim's init hook instead of `--bf16`)."""
    from slime.arguments import parse_args
    from slime.backends.megatron.offload import TrainOffloader
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer
    from slime.utils.types import Sample, Status

    args = parse_args([
        "--hf-checkpoint", str(ckpt), "--rollout-batch-size", str(samples // 2), "--n-samples-per-prompt", "2",
        "--num-rollout", "4", "--actor-num-gpus-per-node", "1", "--colocate", "--lr", "1e-6", *extra,
    ])  # fmt: skip
    off = TrainOffloader(args.offload_train, legacy=args.legacy_offload)
    trainer = MegatronTrainer(args, 0, 1, "127.0.0.1", port, offloader=off)
    off.attach(trainer.model, trainer.optimizer)
    rng = random.Random(0)
    vocab = min(trainer.spec.vocab_size, 400)
    batch = [
        Sample(group_index=i // 2, index=i, group_id=i, tokens=[rng.randrange(3, vocab) for _ in range(tokens)],
               response_length=tokens // 2, reward=rng.random(), status=Status.COMPLETED)
        for i in range(samples)
    ]  # fmt: skip
    data, _ = build_rank_data(args, 0, batch, CarryBuffer(), {"dp_size": 1, "cp_size": 1})
    trainer.train(0, data[0])
    return args, trainer, off


def bench_setup(model: str, work: str | None) -> tuple[dict[str, Any], Path, tuple[Any, Any, Any]]:
    """What every trainer bench starts with: the result's header (model, GPU, host, date, torch), the checkpoint
    (built in `work`, or a new temporary directory) and `colocated_trainer` on it."""
    import platform
    import tempfile
    import time

    import torch

    from slime.utils.http_utils import find_free_port

    root = Path(work or tempfile.mkdtemp(prefix="gpu_bench_"))
    res: dict[str, Any] = {"model": model, "gpu": torch.cuda.get_device_name(), "host": platform.node(),
                           "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__}  # fmt: skip
    log(f"checkpoint {model} in {root}")
    ckpt = checkpoint_for(root, model)
    log("trainer: build + one train step")
    return res, ckpt, colocated_trainer(ckpt, find_free_port())


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def write_json(path: str | Path, obj: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1, default=str))
