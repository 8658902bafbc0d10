"""On-policy distillation (OPD): pull the student towards a teacher on the student's own samples.

Per response token t: A_t ← A_t − `--opd-kl-coef` · (ℓ_student,t − ℓ_teacher,t), orthogonal to the advantage
estimator (applied after it, before `--normalize-advantages`). ℓ_student − ℓ_teacher is the one-sample estimate of
the reverse KL(π_student ‖ π_teacher) at that token, so maximising the surrogate lowers it. With several teachers
the teacher log-prob is their per-token mean (slime/rollout/model_scoring.py), which makes the term the mean of the
per-teacher terms.

Every list here is per sample and CP-local (each rank's `slice_response_for_cp` part): the term is elementwise, so
slicing before or after gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def opd_term(student: torch.Tensor, teacher: torch.Tensor, coef: float) -> torch.Tensor:
    """coef · (ℓ_student − ℓ_teacher) per token, without gradient (advantages are constants of the loss)."""
    if student.shape != teacher.shape:
        raise ValueError(f"student log-probs cover {tuple(student.shape)} tokens, teacher's {tuple(teacher.shape)}")
    return coef * (student.detach().float() - teacher.detach().to(student.device, torch.float32))


def apply_opd(
    advantages: Sequence[torch.Tensor],
    student: Sequence[torch.Tensor],
    teacher: Sequence[torch.Tensor | Sequence[float]],
    coef: float,
) -> list[torch.Tensor]:
    """A − coef·(ℓ_student − ℓ_teacher) for every sample."""
    if not (len(advantages) == len(student) == len(teacher)):
        raise ValueError(f"{len(advantages)} advantages, {len(student)} student and {len(teacher)} teacher log-probs")
    out = []
    for a, s, t in zip(advantages, student, teacher, strict=True):
        term = opd_term(s, torch.as_tensor(t, dtype=torch.float32), coef)
        out.append(a - term.to(a.device, a.dtype))
    return out
