"""Training roles (actor, critic) and `--megatron-config`: per-role overrides of the training flags.

The YAML (docs/megatron_contract.md#role-overrides)::

    megatron:
      - name: default
        role: actor
        overrides: {lr: 1.0e-6, save: /ckpt/actor}
      - name: default
        role: critic
        overrides: {lr: 1.0e-5, load: /ckpt/critic, save: /ckpt/critic}

Override keys are `args` attribute names (flag dests); each value is coerced to its flag's type (YAML reads
`1e-5` as a string). A role's args are a copy of the command line's with its overrides applied; a role the file
does not list inherits the command line. Why the topology may not differ per role: the critic lives on the
actor's GPUs with the actor's rank layout, and critic worker i hands its values to actor worker i, so both must
split the batch the same way. Everything is checked in the driver, before `ray.init`.

The critic's own rules (`role_args(args, "critic")`): no KL shaping or KL loss and no actor-side hooks (its
returns are those of the task reward, as in slime v0.3.0), and its checkpoints default to `critic/` under the
actor's `--load` / `--save` unless `--critic-load` / `--critic-save` or the YAML say otherwise.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import os
from typing import Any

import yaml

from slime.utils.errors import SlimeArgError
from slime.utils.yaml_nodes import YamlContext, as_mapping, as_sequence, as_str, compose_file, kind

FLAG = "--megatron-config"
ROLES = ("actor", "critic")
ENTRY_KEYS = ("name", "role", "overrides", "args")  # `args`: slime's older spelling of `overrides`
# One rank layout for both roles (critic worker i feeds actor worker i); resources come from the command line.
TOPOLOGY = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "microbatch_group_size_per_vp_stage",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "sequence_parallel",
    "actor_num_nodes",
    "actor_num_gpus_per_node",
    "world_size",
)
# Flag groups whose flags a role may override (the trainer's), less the run-wide ones among them; plus the
# critic's starting checkpoint (the actor's must be the engines' model: --hf-checkpoint on the command line).
ROLE_GROUPS = ("training (Megatron-style)", "algorithm")
RUN_WIDE = (
    "advantage_estimator",
    "num_critic_only_steps",
    "megatron_config",
    "critic_load",
    "critic_save",
    "disable_grpo_std_normalization",
    "disable_rewards_normalization",
    "update_weight_mode",
    "update_weights_interval",
    "check_weight_update_equal",
    "distributed_backend",
    "distributed_timeout_minutes",
    "custom_megatron_init_path",
)
CRITIC_ONLY = ("hf_checkpoint",)
# What the critic never does, whatever the command line says for the actor.
CRITIC_FIXED = {
    "kl_coef": 0.0,
    "use_kl_loss": False,
    "kl_loss_coef": 0.0,
    "ref_load": None,
    "ref_update_interval": None,
    "use_opd": False,  # OPD shapes the actor's advantages; the critic fits the task reward's returns
    "opd_type": None,
    "opd_teacher_load": None,
    "custom_megatron_before_log_prob_hook_path": None,
    "rollout_data_postprocess_path": None,
    "save_hf": None,
}


def _coerce(ctx: YamlContext, node: yaml.Node, where: str, action: argparse.Action, value: Any) -> Any:
    """`value` as the flag of `action` would have parsed it."""
    if value is None:
        if action.default is not None:
            raise ctx.error(node, where, f"null is not allowed (default {action.default!r})")
        return None
    if action.nargs == 0:  # store_true / store_false / --x/--no-x
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if not isinstance(value, bool):
            raise ctx.error(node, where, f"expected true or false, got {kind(node)}")
        return value
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        if not isinstance(value, list):
            raise ctx.error(node, where, f"expected a list, got {kind(node)}")
        return [_scalar(ctx, node, where, action, v) for v in value]
    return _scalar(ctx, node, where, action, value)


def _scalar(ctx: YamlContext, node: yaml.Node, where: str, action: argparse.Action, value: Any) -> Any:
    typ = action.type
    if isinstance(value, bool) and typ in (int, float):
        raise ctx.error(node, where, f"expected a number, got {value!r}")
    try:
        if typ is int and isinstance(value, float):
            if not value.is_integer():
                raise ValueError(value)
            value = int(value)
        elif callable(typ) and (isinstance(value, str) or typ is float):
            value = typ(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ctx.error(node, where, f"cannot read {value!r} as {getattr(typ, '__name__', typ)} ({e})") from None
    if action.choices is not None and value not in action.choices:
        raise ctx.error(node, where, f"{value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def load_megatron_config(path: str, parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, dict]:
    """{role: {dest: coerced value}} from `path`; every mistake is one `SlimeArgError` line (file:line: path)."""
    ctx = YamlContext(FLAG, path)
    root = compose_file(FLAG, path)
    if root is None:
        raise SlimeArgError(f"{FLAG} {path}: the file is empty; expected a top-level `megatron:` list")
    top = as_mapping(ctx, root, "", ("megatron",))
    if "megatron" not in top:
        raise ctx.error(root, "", "expected a top-level `megatron:` list")
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    per_role = {a.dest for g in parser._action_groups if g.title in ROLE_GROUPS for a in g._group_actions}
    per_role = (per_role - set(RUN_WIDE)) | set(CRITIC_ONLY)
    roles: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(as_sequence(ctx, top["megatron"], "megatron")):
        where = f"megatron[{i}]"
        fields = as_mapping(ctx, entry, where, ENTRY_KEYS)
        if "role" not in fields:
            raise ctx.error(entry, where, f"`role` is required ({' or '.join(ROLES)})")
        role = as_str(ctx, fields["role"], f"{where}.role")
        if role not in ROLES:
            raise ctx.error(fields["role"], f"{where}.role", f"{role!r} is not a role; expected one of {ROLES}")
        if role in roles:
            raise ctx.error(fields["role"], f"{where}.role", f"role {role!r} is listed twice (one entry per role)")
        if "name" in fields:
            as_str(ctx, fields["name"], f"{where}.name")
        if "overrides" in fields and "args" in fields:
            raise ctx.error(entry, where, "give `overrides` or its older name `args`, not both")
        body = fields.get("overrides", fields.get("args"))
        overrides: dict[str, Any] = {}
        if body is not None and not (isinstance(body, yaml.ScalarNode) and ctx.value(body) is None):
            key_where = f"{where}.{'overrides' if 'overrides' in fields else 'args'}"
            for key, vnode in as_mapping(ctx, body, key_where, None).items():
                dest = key.replace("-", "_")
                kw = f"{key_where}.{key}"
                if dest not in actions:
                    close = difflib.get_close_matches(dest, list(actions), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise ctx.error(vnode, kw, f"unknown flag{hint}")
                if dest not in per_role or (dest in CRITIC_ONLY and role != "critic"):
                    raise ctx.error(vnode, kw, "applies to the whole run, not to one role: set it on the command line")
                value = _coerce(ctx, vnode, kw, actions[dest], ctx.value(vnode))
                if dest in TOPOLOGY and value != getattr(args, dest):
                    raise ctx.error(
                        vnode, kw, f"the parallel topology is shared by actor and critic ({getattr(args, dest)!r} "
                        "on the command line); set it there, not per role",
                    )  # fmt: skip
                overrides[dest] = value
        roles[role] = overrides
    if "critic" in roles and args.advantage_estimator != "ppo":
        raise SlimeArgError(f"{FLAG} {path}: a critic entry needs --advantage-estimator ppo")
    return roles


def resolve_roles(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Validate `--megatron-config` / `--critic-load` / `--critic-save` and store the overrides on `args`."""
    roles = load_megatron_config(args.megatron_config, parser, args) if args.megatron_config else {}
    critic = roles.setdefault("critic", {}) if args.advantage_estimator == "ppo" else roles.get("critic")
    for flag, key, value in (("--critic-load", "load", args.critic_load), ("--critic-save", "save", args.critic_save)):
        if value is None:
            continue
        if critic is None:
            raise SlimeArgError(f"{flag} needs --advantage-estimator ppo (there is no critic otherwise)")
        if key in critic and critic[key] != value:
            raise SlimeArgError(f"{flag} {value} and {FLAG}'s critic {key}: {critic[key]} disagree; give one")
        critic[key] = value
    args.role_overrides = roles


def role_args(args: argparse.Namespace, role: str) -> argparse.Namespace:
    """A copy of `args` for `role` with its overrides applied (the role's trainers read only this copy)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    out = copy.deepcopy(args)
    overrides = args.role_overrides.get(role, {})
    for dest, value in overrides.items():
        setattr(out, dest, value)
    if role == "critic":
        for dest, value in CRITIC_FIXED.items():
            setattr(out, dest, value)
        actor = role_args(args, "actor")
        for key in ("load", "save"):
            if key not in overrides:
                base = getattr(actor, key)
                setattr(out, key, os.path.join(base, "critic") if base else None)
    return out
