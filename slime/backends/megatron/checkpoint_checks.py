"""Read every checkpoint a run will build a megatron model from, in the driver, before Ray starts.

Why: the trainer reads `config.json` inside its Ray actor, so an architecture it cannot build (a model type,
RoPE scaling, an MoE layout) used to surface after the cluster and the engines had started. Here the same
`read_hf_config` and layout checks run on the actor's and the critic's `--hf-checkpoint` (each role's own, after
`--megatron-config`), `--ref-load` and `--opd-teacher-load`.
"""

from __future__ import annotations

import os
from argparse import Namespace

from slime.backends.megatron.hf_config import check_layout_fits, read_hf_config
from slime.backends.megatron.roles import role_args
from slime.utils.errors import SlimeArgError


def checkpoints_to_build(args: Namespace) -> list[tuple[str, str, Namespace]]:
    """(what, HF directory, the role's args) of every model a train rank builds from an HF checkpoint."""
    if args.debug_rollout_only:
        return []
    roles = ["critic", "actor"] if args.advantage_estimator == "ppo" else ["actor"]
    out = []
    for role in roles:
        r = role_args(args, role)
        out.append((f"{role} --hf-checkpoint" if role != "actor" else "--hf-checkpoint", r.hf_checkpoint, r))
    actor = role_args(args, "actor")
    if actor.ref_load and (actor.use_kl_loss or actor.kl_coef) and not actor.ref_model_name:
        out.append(("--ref-load", actor.ref_load, actor))
    if actor.use_opd and actor.opd_type == "megatron" and actor.opd_teacher_load:
        out.append(("--opd-teacher-load", actor.opd_teacher_load, actor))
    return out


def check_checkpoints(args: Namespace) -> None:
    """Every checkpoint's architecture is one the megatron backend builds, in the run's layout; one line if not."""
    for what, path, role in checkpoints_to_build(args):
        if not path:
            raise SlimeArgError(f"{what} is required (an HF checkpoint directory)")
        try:
            spec = read_hf_config(path)
        except SlimeArgError as e:
            raise SlimeArgError(str(e).replace("--hf-checkpoint", what, 1)) from None
        except KeyError as e:
            raise SlimeArgError(f"{what} {path}: config.json has no {e.args[0]!r}") from None
        except (OSError, ValueError) as e:  # unreadable or not JSON
            raise SlimeArgError(f"{what} {path}: cannot read {os.path.join(path, 'config.json')} ({e})") from None
        check_layout_fits(spec, role)
        if spec.rope_type == "dynamic" and role.context_parallel_size > 1:
            # its frequencies follow the row's longest position, which each CP rank sees only its chunks of
            raise SlimeArgError(
                f"{what} {path}: dynamic RoPE scaling with --context-parallel-size > 1 is not supported"
            )
