"""Build everything the toy quick start needs, offline: a tiny checkpoint and a digit-reversal dataset.

    python -m examples.toy.prepare --out DIR [--num-train 512 --num-eval 64 --seed 0] [--skip-model]
        [--hidden-size 64 --num-layers 2 --num-heads 4 --num-kv-heads 2 --intermediate-size 128]

writes `DIR/model` (tiny Qwen2 + tokenizer + chat template, random init) and `DIR/data/{train,eval}.jsonl`.
Why this task: the reward is verifiable by a few lines of code, answers are short (6-8 digits, so CPU rollouts
are cheap), and partial credit per position gives a tiny model a learning signal. Prompts are chat messages so
`--apply-chat-template` is exercised exactly as with a real chat model.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PROMPT_PREFIX = "Reverse the digits: "
MIN_LEN, MAX_LEN = 6, 8
# Shape options forwarded to `sim.tiny_checkpoint.build_tiny_checkpoint` (unset: its defaults).
_MODEL_FLAGS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")


def _digit_string(rng: random.Random) -> str:
    n = rng.randint(MIN_LEN, MAX_LEN)
    # Last digit non-zero, so the label (the reversal) never has a leading zero that a numeric grader would drop.
    return "".join(rng.choice("0123456789") for _ in range(n - 1)) + rng.choice("123456789")


def make_row(digits: str) -> dict[str, Any]:
    return {
        "input": [{"role": "user", "content": PROMPT_PREFIX + digits}],
        "label": digits[::-1],
        # `math` is the built-in fallback grader (exact answer) when no --custom-rm-path is given.
        "metadata": {"rm_type": "math", "num_digits": len(digits)},
    }


def make_splits(num_train: int, num_eval: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train/eval rows, a pure function of the arguments."""
    rng = random.Random(seed)
    seen: set[str] = set()
    strings: list[str] = []
    while len(strings) < num_train + num_eval:
        s = _digit_string(rng)
        if s not in seen:  # unique prompts => the held-out split shares no prompt with train
            seen.add(s)
            strings.append(s)
    rows = [make_row(s) for s in strings]
    return rows[num_eval:], rows[:num_eval]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


def prepare(
    out: str | Path,
    num_train: int = 512,
    num_eval: int = 64,
    seed: int = 0,
    build_model: bool = True,
    model_kwargs: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write the dataset (and the tiny checkpoint) under `out`; returns the paths a run needs.

    `model_kwargs` (hidden_size, num_layers, ...) reshape the random-init model: the default 64-wide 2-layer
    model is the cheapest that runs, while the learning benchmark (`bench/toy_learning.py`) wants one that
    learns the task in a few minutes of CPU time.
    """
    out = Path(out)
    train, evaluation = make_splits(num_train, num_eval, seed)
    paths = {"train": out / "data" / "train.jsonl", "eval": out / "data" / "eval.jsonl", "model": out / "model"}
    write_jsonl(paths["train"], train)
    write_jsonl(paths["eval"], evaluation)
    if build_model:
        # sim/ is the offline stand-in for a model download; examples may use it, slime/ never does.
        from sim.tiny_checkpoint import build_tiny_checkpoint

        build_tiny_checkpoint(
            paths["model"], seed=seed, extra_corpus=[PROMPT_PREFIX + "4817263"], **(model_kwargs or {})
        )
    logger.info("toy task ready: %d train / %d eval rows in %s", len(train), len(evaluation), out / "data")
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Prepare the toy digit-reversal task (tiny model + data), offline.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-train", type=int, default=512)
    p.add_argument("--num-eval", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-model", action="store_true", help="only write the dataset")
    m = p.add_argument_group("model shape (defaults: the tiny quick-start model)")
    for flag in _MODEL_FLAGS:
        m.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None)
    a = p.parse_args(argv)
    if a.num_train < 0 or a.num_eval < 0:
        p.error("--num-train and --num-eval must be >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_kwargs = {k: getattr(a, k) for k in _MODEL_FLAGS if getattr(a, k) is not None}
    paths = prepare(a.out, a.num_train, a.num_eval, a.seed, build_model=not a.skip_model, model_kwargs=model_kwargs)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
