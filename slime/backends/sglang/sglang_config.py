"""`--sglang-config` YAML: the inference topology (models, server groups, routers); docs/sglang_config.md.

Why a hand-written loader over `yaml.compose` nodes: every user mistake must come back as one line that names
the file, the YAML path (`sglang[1].server_groups[0].overrides.mem_fraction`) and the line, and only the node
tree keeps line numbers. All resolution rules live here (engine size, model path, weight-sync target, GPU
sums, exclusions), so the deployment plan, `slime plan` and the launcher read one resolved structure.

Without `--sglang-config` the same structure is synthesised from the flags: one model with one regular group
(or the legacy `--prefill-num-servers` prefill + decode split).
"""

from __future__ import annotations

import logging
import os
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

import yaml

from slime.backends.sglang import server_plugins
from slime.backends.sglang.flags import validate_override_keys
from slime.utils.errors import SlimeArgError
from slime.utils.yaml_nodes import YamlContext as _Ctx
from slime.utils.yaml_nodes import as_bool as _bool
from slime.utils.yaml_nodes import as_mapping as _mapping
from slime.utils.yaml_nodes import as_positive_int as _pos_int
from slime.utils.yaml_nodes import as_sequence as _seq
from slime.utils.yaml_nodes import as_str as _str
from slime.utils.yaml_nodes import compose_file

logger = logging.getLogger(__name__)

WORKER_TYPES = ("regular", "prefill", "decode", "placeholder", "encoder")
ENGINE_WORKER_TYPES = ("regular", "prefill", "decode")
MODEL_KEYS = ("name", "model_path", "update_weights", "num_gpus_per_engine", "server_groups", "engine_groups")
GROUP_KEYS = ("worker_type", "num_gpus", "num_gpus_per_engine", "overrides")
DEFAULT_MODEL_NAME = "default"
FLAG = "--sglang-config"


@dataclass(frozen=True)
class ServerGroupConfig:
    """One homogeneous group of engines, all values resolved."""

    worker_type: str
    num_gpus: int
    num_gpus_per_engine: int
    model_path: str
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def is_placeholder(self) -> bool:
        return self.worker_type == "placeholder"


@dataclass(frozen=True)
class ModelConfig:
    name: str
    model_path: str
    update_weights: bool
    receives_weights: bool  # only the first model with update_weights true is synced (one trained policy)
    num_gpus_per_engine: int
    server_groups: tuple[ServerGroupConfig, ...]
    # {server plugin: {YAML key: value}}: a block named after a plugin sets its flags for this model's engines when
    # that plugin serves the run (server_plugins.py); real SGLang ignores them
    plugin_blocks: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def is_pd(self) -> bool:
        return any(g.worker_type in ("prefill", "decode") for g in self.server_groups)

    @property
    def num_gpus(self) -> int:
        return sum(g.num_gpus for g in self.server_groups)


@dataclass(frozen=True)
class SGLangConfig:
    models: tuple[ModelConfig, ...]
    source: str | None = None  # the YAML file, or None when synthesised from flags

    @property
    def num_gpus(self) -> int:
        return sum(m.num_gpus for m in self.models)

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def weight_sync_model(self) -> ModelConfig | None:
        return next((m for m in self.models if m.receives_weights), None)


# ---- loading and resolution -----------------------------------------------------------------------------------


def _compose(path: str) -> yaml.Node:
    node = compose_file(FLAG, path)
    if node is None:
        raise SlimeArgError(f"--sglang-config {path}: the file is empty; expected a top-level `sglang:` list")
    return node


def _per_engine(group_size: int, gpus_per_node: int) -> int:
    """GPUs one engine process holds: engines larger than a node span nodes, one process per node."""
    return min(group_size, gpus_per_node)


def _load_group(
    ctx: _Ctx, node: yaml.Node, where: str, args: Namespace, model_gpe: int, model_path: str
) -> tuple[ServerGroupConfig, yaml.Node]:
    m = _mapping(ctx, node, where, GROUP_KEYS)
    worker_type = "regular"
    if "worker_type" in m:
        worker_type = ctx.value(m["worker_type"]) if isinstance(m["worker_type"], yaml.ScalarNode) else None
        if worker_type not in WORKER_TYPES:
            raise ctx.error(
                m["worker_type"], f"{where}.worker_type", f"unknown worker_type {worker_type!r}; expected one of "
                f"{', '.join(WORKER_TYPES)}"
            )  # fmt: skip
        if worker_type == "encoder":
            raise ctx.error(
                m["worker_type"], f"{where}.worker_type", "encoder groups (EPD) are not supported by this slime build"
            )
    if "num_gpus" not in m:
        raise ctx.error(node, f"{where}.num_gpus", "required key missing (total GPUs of the group)")
    num_gpus = _pos_int(ctx, m["num_gpus"], f"{where}.num_gpus")
    gpe = (
        _pos_int(ctx, m["num_gpus_per_engine"], f"{where}.num_gpus_per_engine")
        if "num_gpus_per_engine" in m
        else model_gpe
    )
    overrides: dict[str, Any] = {}
    if "overrides" in m:
        om = _mapping(ctx, m["overrides"], f"{where}.overrides", None)
        for key, vnode in om.items():
            validate_override_keys(
                [key], f"--sglang-config {ctx.path}:{vnode.start_mark.line + 1}: {where}.overrides.{key}"
            )
            overrides[key.replace("-", "_")] = ctx.value(vnode)
    if worker_type != "placeholder":
        node_size = _per_engine(gpe, args.num_gpus_per_node)
        if gpe > args.num_gpus_per_node and gpe % args.num_gpus_per_node:
            raise ctx.error(
                node, f"{where}.num_gpus_per_engine",
                f"an engine of {gpe} GPUs spans nodes and must be a multiple of --num-gpus-per-node "
                f"({args.num_gpus_per_node})",
            )  # fmt: skip
        if num_gpus % gpe:
            raise ctx.error(
                m["num_gpus"], f"{where}.num_gpus", f"{num_gpus} GPUs is not a multiple of {gpe} GPUs per engine"
            )
        assert num_gpus % node_size == 0
    path = overrides.pop("model_path", None) or model_path
    if not isinstance(path, str) or not path:
        raise ctx.error(node, f"{where}.overrides.model_path", "expected a non-empty string")
    return ServerGroupConfig(worker_type, num_gpus, gpe, path, overrides), node


def _load_model(ctx: _Ctx, node: yaml.Node, where: str, args: Namespace) -> tuple[dict[str, Any], yaml.Node]:
    m = _mapping(ctx, node, where, (*MODEL_KEYS, *server_plugins.registered()))
    if "name" not in m:
        raise ctx.error(node, f"{where}.name", "required key missing (unique model name)")
    name = _str(ctx, m["name"], f"{where}.name")
    explicit_path = _str(ctx, m["model_path"], f"{where}.model_path") if "model_path" in m else None
    model_path = explicit_path or args.hf_checkpoint
    update = _bool(ctx, m["update_weights"], f"{where}.update_weights") if "update_weights" in m else None
    default_gpe = args.rollout_num_gpus_per_engine
    gpe = (
        _pos_int(ctx, m["num_gpus_per_engine"], f"{where}.num_gpus_per_engine")
        if "num_gpus_per_engine" in m
        else default_gpe
    )
    if "server_groups" in m and "engine_groups" in m:
        raise ctx.error(m["engine_groups"], f"{where}.engine_groups", "give server_groups or its alias, not both")
    gkey = "server_groups" if "server_groups" in m else "engine_groups"
    if gkey not in m:
        raise ctx.error(node, f"{where}.server_groups", "required key missing (list of server groups)")
    groups = []
    for i, gnode in enumerate(_seq(ctx, m[gkey], f"{where}.{gkey}")):
        groups.append(_load_group(ctx, gnode, f"{where}.{gkey}[{i}]", args, gpe, model_path))
    paths = {g.model_path for g, _ in groups if not g.is_placeholder}
    if len(paths) > 1:
        raise ctx.error(
            node, f"{where}.server_groups", f"all groups of one model must serve one model path, got {sorted(paths)}"
        )
    types = {g.worker_type for g, _ in groups} - {"placeholder"}
    if not types:
        raise ctx.error(m[gkey], f"{where}.{gkey}", "the model has only placeholder groups, so no engine serves it")
    if "regular" in types and types & {"prefill", "decode"}:
        raise ctx.error(m[gkey], f"{where}.{gkey}", "regular and prefill/decode groups cannot be mixed in one model")
    if types & {"prefill", "decode"} and types != {"prefill", "decode"}:
        missing = ({"prefill", "decode"} - types).pop()
        raise ctx.error(
            m[gkey], f"{where}.{gkey}", f"a PD model needs both prefill and decode groups; {missing} is missing"
        )
    blocks: dict[str, dict[str, Any]] = {}
    for pname, plugin in server_plugins.registered().items():
        if pname not in m:
            continue
        block: dict[str, Any] = {}
        for k, vnode in _mapping(ctx, m[pname], f"{where}.{pname}", tuple(plugin.model_keys)).items():
            value = _str(ctx, vnode, f"{where}.{pname}.{k}")
            if k in plugin.path_keys and not os.path.isabs(value):
                value = os.path.join(os.path.dirname(os.path.abspath(ctx.path)), value)
            block[k] = value
        why = plugin.check_model_block(block)
        if why is not None:
            raise ctx.error(m[pname], f"{where}.{pname}", why)
        blocks[pname] = block
    effective_path = next(iter(paths)) if paths else model_path
    raw = {
        "name": name, "model_path": effective_path, "update_weights": update, "num_gpus_per_engine": gpe,
        "server_groups": tuple(g for g, _ in groups), "plugin_blocks": blocks, "name_node": m["name"],
        "update_node": m.get("update_weights"),
    }  # fmt: skip
    return raw, node


def _resolve(raws: list[dict[str, Any]], args: Namespace, ctx: _Ctx | None) -> tuple[ModelConfig, ...]:
    def err(node: yaml.Node | None, where: str, msg: str) -> SlimeArgError:
        return ctx.error(node, where, msg) if ctx is not None else SlimeArgError(msg)

    seen: set[str] = set()
    for i, r in enumerate(raws):
        if r["name"] in seen:
            raise err(r.get("name_node"), f"sglang[{i}].name", f"duplicate model name {r['name']!r}")
        seen.add(r["name"])
    explicit = [i for i, r in enumerate(raws) if r["update_weights"] is True]
    if len(explicit) > 1 and not args.debug_rollout_only:
        j = explicit[1]
        raise err(
            raws[j].get("update_node"), f"sglang[{j}].update_weights",
            f"models {raws[explicit[0]]['name']!r} and {raws[j]['name']!r} both set update_weights: true; "
            "weight sync to several models is not supported (only one model may receive training weights)",
        )  # fmt: skip
    models = []
    receiver_taken = False
    for r in raws:
        update = r["update_weights"]
        if update is None:
            update = r["model_path"] == args.hf_checkpoint
            if not update:
                logger.warning(
                    "model %r serves %s, not --hf-checkpoint: it will not receive weight updates",
                    r["name"],
                    r["model_path"],
                )
        receives = bool(update) and not receiver_taken
        if update and receiver_taken:
            logger.warning("model %r has update_weights but only the first such model is synced", r["name"])
        receiver_taken = receiver_taken or bool(update)
        models.append(
            ModelConfig(
                name=r["name"], model_path=r["model_path"], update_weights=bool(update), receives_weights=receives,
                num_gpus_per_engine=r["num_gpus_per_engine"], server_groups=r["server_groups"],
                plugin_blocks=r["plugin_blocks"],
            )
        )  # fmt: skip
    return tuple(models)


def load_sglang_config(path: str, args: Namespace) -> SGLangConfig:
    """Parse and resolve `path` against the flags; raises SlimeArgError (one line: file:line: yaml.path: why)."""
    ctx = _Ctx(FLAG, path)
    if args.prefill_num_servers is not None:
        raise SlimeArgError(
            f"--sglang-config {path}: excludes --prefill-num-servers; declare prefill/decode groups in the YAML"
        )
    if args.rollout_external:
        raise SlimeArgError(f"--sglang-config {path}: excludes --rollout-external (external engines are not launched)")
    root = _compose(path)
    top = _mapping(ctx, root, "", ("sglang",))
    if "sglang" not in top:
        raise ctx.error(root, "sglang", "required top-level key missing (list of models)")
    raws = [_load_model(ctx, n, f"sglang[{i}]", args)[0] for i, n in enumerate(_seq(ctx, top["sglang"], "sglang"))]
    models = _resolve(raws, args, ctx)
    total = sum(m.num_gpus for m in models)
    if total != args.rollout_num_gpus:
        per_model = ", ".join(f"{m.name}={m.num_gpus}" for m in models)
        raise ctx.error(
            top["sglang"], "sglang", f"server groups use {total} GPUs ({per_model}) but --rollout-num-gpus is "
            f"{args.rollout_num_gpus}; the two must be equal"
        )  # fmt: skip
    return SGLangConfig(models, source=path)


def config_from_flags(args: Namespace) -> SGLangConfig:
    """The topology slime builds without a YAML: one regular group, or the legacy prefill/decode split."""
    gpe = args.rollout_num_gpus_per_engine
    name = args.model_name or DEFAULT_MODEL_NAME
    path = args.hf_checkpoint
    n = args.rollout_num_gpus
    if args.prefill_num_servers:
        prefill = args.prefill_num_servers * gpe
        if prefill >= n:
            raise SlimeArgError(
                f"--prefill-num-servers {args.prefill_num_servers} x {gpe} GPUs leaves no decode GPUs of "
                f"--rollout-num-gpus {n}"
            )
        groups = (
            ServerGroupConfig("prefill", prefill, gpe, path),
            ServerGroupConfig("decode", n - prefill, gpe, path),
        )
    else:
        groups = (ServerGroupConfig("regular", n, gpe, path),)
    return SGLangConfig((ModelConfig(name, path, True, True, gpe, groups),), source=None)


def resolve_sglang_config(args: Namespace) -> SGLangConfig:
    """The run's topology: from `--sglang-config` when given, else from the flags."""
    if args.sglang_config:
        return load_sglang_config(args.sglang_config, args)
    return config_from_flags(args)


def referenced_models(args: Namespace) -> dict[str, str]:
    """Models of the topology that flags name, {model: flag}: OPD teachers, the served reference, the reward model."""
    out: dict[str, str] = {}
    if args.use_opd and args.opd_type == "sglang":
        out.update(dict.fromkeys(args.opd_teacher_models, "--opd-teacher-models"))
    if args.ref_model_name:
        out[args.ref_model_name] = "--ref-model-name"
    if not args.custom_rm_path and args.rm_type in ("reward_model", "reward_model_chat"):
        out[args.rm_model_name] = "--rm-model-name"
    return out


def check_model_references(args: Namespace) -> None:
    """Every model a flag names is served by the topology, and none of them is the trained one (a teacher, a
    reference or a judge that received the actor's weights would score the actor against itself)."""
    wanted = referenced_models(args)
    if not wanted or args.debug_train_only or args.rollout_external:
        return
    config = resolve_sglang_config(args)
    names = {m.name for m in config.models}
    for name, flag in wanted.items():
        if name not in names:
            raise SlimeArgError(f"{flag} {name}: no such model in {config.source or 'the topology'} "
                                f"(models: {', '.join(sorted(names))}); declare it in --sglang-config")  # fmt: skip
        if config.model(name).receives_weights:
            raise SlimeArgError(f"{flag} {name}: that model receives the actor's weights; set update_weights: false")
