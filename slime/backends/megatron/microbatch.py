"""`MicroBatch`: one micro-batch of a train rank's samples, as the RL step fills it in.

The rollout side hands each rank per-sample lists plus the schedule (docs/architecture.md#train-data);
`microbatches` cuts them into the schedule's micro-batches. A micro-batch starts with what the rollout side
knows (tokens, lengths, loss masks, the group denominators, rewards, engine log-probs) and gains, field by
field, what the step computes: π_old / π_ref / teacher log-probs, the critic's values, advantages and returns.

Hooks keep slime v0.3.0's signatures: the loss, the advantage estimators and `--custom-*` functions receive
`mb.batch()`, the plain dict of the fields set so far (whatever they write into it is read back where the
signature says so), and `--rollout-data-postprocess-path` sees the rank's samples as lists (`rollout_data_view`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# per-sample log-probs the rollout side may send (engine, teacher, served reference), as lists of floats
ROLLOUT_LOG_PROBS = ("rollout_log_probs", "teacher_log_probs", "ref_log_probs")
# per-response-token inputs of the loss, whole per sample until the loss takes this rank's part (CP)
RESPONSE_FIELDS = ("loss_masks", "advantages", "returns", "log_probs", "ref_log_probs", "rollout_log_probs", "values")
# per-sample fields a --rollout-data-postprocess-path hook sees, and may replace, on the train side
POSTPROCESS_FIELDS = (
    "loss_masks",
    "rewards",
    "log_probs",
    "ref_log_probs",
    "rollout_log_probs",
    "teacher_log_probs",
    "advantages",
    "returns",
)


@dataclass
class MicroBatch:
    """Per-sample lists, in this micro-batch's order; `indices` are the samples' positions in the rank's data.

    Empty (no tokens) on a rank with nothing to do in a step: it still joins the schedule with one dummy token."""

    tokens: list[list[int]]
    total_lengths: list[int]
    response_lengths: list[int] | None  # None: bare token rows, no responses (a forward-only caller's)
    indices: list[int] = dataclasses.field(default_factory=list)
    loss_masks: list[Any] | None = None  # 0/1 lists from the rollout side; float tensors once `prepare`d
    group_mask_sums: list[float] | None = None
    rewards: list[float] | None = None
    rollout_log_probs: list[Any] | None = None  # lists from the rollout side, tensors once `prepare`d
    teacher_log_probs: list[Any] | None = None
    ref_log_probs: list[Any] | None = None
    log_probs: list[Any] | None = None  # π_old, recomputed (or the engine's under --use-rollout-logprobs)
    values: list[Any] | None = None  # PPO: the critic's old values (the actor's input, the critic's own)
    advantages: list[Any] | None = None
    returns: list[Any] | None = None

    @classmethod
    def rows(cls, tokens: list[list[int]]) -> MicroBatch:
        """Bare token rows to run forward (no responses, nothing to score)."""
        return cls(tokens=tokens, total_lengths=[len(t) for t in tokens], response_lengths=None)

    @property
    def empty(self) -> bool:
        return not self.tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self) -> dict[str, Any]:
        """The fields set so far as the dict of slime v0.3.0's hooks and losses (`batch["advantages"]` ...)."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


def microbatches(data: dict[str, Any]) -> list[MicroBatch]:
    """The rank's micro-batches in schedule order (steps concatenated)."""
    per_sample = ("tokens", "total_lengths", "response_lengths", "loss_masks", "group_mask_sums", "rewards")
    optional = [k for k in ROLLOUT_LOG_PROBS if k in data]
    return [
        MicroBatch(indices=list(idx), **{k: [data[k][i] for i in idx] for k in (*per_sample, *optional)})
        for idx in data["micro_batch_indices"]
    ]


def logprob_batches(mbs: list[MicroBatch], max_tokens: int | None) -> list[tuple[MicroBatch, list[tuple[int, int]]]]:
    """The batches of the no-grad log-prob passes, each with where its samples go back (micro-batch, position).

    By default they are the training micro-batches. `max_tokens` (`--log-probs-max-tokens-per-gpu`) regroups the
    rank's samples, in order, into batches of at most that many tokens (no activations are kept, so larger
    batches fit, and siblings of one prompt share its rows more often); a longer sample runs alone."""
    if max_tokens is None:
        return [(mb, [(j, p) for p in range(len(mb))]) for j, mb in enumerate(mbs)]
    out: list[tuple[MicroBatch, list[tuple[int, int]]]] = []
    cur, targets = MicroBatch([], [], []), []
    for j, mb in enumerate(mbs):
        for p, (t, n, r) in enumerate(zip(mb.tokens, mb.total_lengths, mb.response_lengths, strict=True)):
            if cur.tokens and sum(cur.total_lengths) + n > max_tokens:
                out.append((cur, targets))
                cur, targets = MicroBatch([], [], []), []
            cur.tokens.append(t)
            cur.total_lengths.append(n)
            cur.response_lengths.append(r)
            targets.append((j, p))
    if cur.tokens:
        out.append((cur, targets))
    return out


def flat_fields(mbs: list[MicroBatch], names: tuple[str, ...]) -> dict[str, list[Any]]:
    """The rank's samples across micro-batches, in order: each named field that every non-empty micro-batch has
    (all of them, as empty lists, on a rank without samples, which still joins the collectives)."""
    full = [mb for mb in mbs if len(mb)]
    return {
        name: [x for mb in full for x in getattr(mb, name)]
        for name in names
        if all(getattr(mb, name) is not None for mb in full)
    }


def rollout_data_view(data: dict[str, Any], mbs: list[MicroBatch]) -> dict[str, list[Any]]:
    """This rank's samples as lists in train-data order (slime's `rollout_data`), with the step's fields so far."""
    n = len(data["tokens"])
    view = {k: list(v) for k, v in data.items() if isinstance(v, list) and len(v) == n}
    for name in POSTPROCESS_FIELDS:
        if all(getattr(mb, name) is not None for mb in mbs):
            col: list[Any] = [None] * n
            for mb in mbs:
                for i, x in zip(mb.indices, getattr(mb, name), strict=True):
                    col[i] = x
            view[name] = col
    return view


def write_back(view: dict[str, list[Any]], mbs: list[MicroBatch], n: int) -> None:
    """What a postprocess hook left in `view` goes back into the micro-batches (their samples' positions)."""
    for name in POSTPROCESS_FIELDS:
        if name in view:
            if len(view[name]) != n:
                raise ValueError(f"rollout data postprocess: {name!r} has {len(view[name])} entries, expected {n}")
            for mb in mbs:
                setattr(mb, name, [view[name][i] for i in mb.indices])
