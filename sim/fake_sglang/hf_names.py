"""The fake engine's tensors under the names a checkpoint on disk (and a trainer's weight sync) uses.

transformers >= 5 holds the experts of an MoE layer as two fused tensors, `mlp.experts.gate_up_proj`
([experts, 2 × moe_intermediate, hidden]: each expert's gate rows, then its up rows) and `mlp.experts.down_proj`
([experts, hidden, moe_intermediate]), but saves and loads checkpoints per expert
(`mlp.experts.{e}.gate_proj.weight`, `.up_proj.weight`, `.down_proj.weight`) — the names slime's trainer exports.
Here each per-expert name maps to a view of its fused tensor, so a weight sync writes straight into the model and
the weight checker hashes exactly what was sent. SGLang keeps its own fused layout behind its loader the same way.
"""

from __future__ import annotations

import torch

_FUSED_GATE_UP = "experts.gate_up_proj"
_FUSED_DOWN = "experts.down_proj"


def checkpoint_named_tensors(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`named` (a model's `named_parameters()` or `state_dict()` items) with fused expert tensors split into
    per-expert views under their checkpoint names; everything else unchanged, in order."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in named:
        if name.endswith(_FUSED_GATE_UP) and t.dim() == 3:
            prefix = name[: -len("gate_up_proj")]
            rows = t.shape[1] // 2
            for e in range(t.shape[0]):
                out.append((f"{prefix}{e}.gate_proj.weight", t[e, :rows]))
                out.append((f"{prefix}{e}.up_proj.weight", t[e, rows:]))
        elif name.endswith(_FUSED_DOWN) and t.dim() == 3:
            prefix = name[: -len("down_proj")]
            out.extend((f"{prefix}{e}.down_proj.weight", t[e]) for e in range(t.shape[0]))
        else:
            out.append((name, t))
    return out
