"""The fake's identity endpoints: `/model_info`, `/server_info`, `/v1/models`, `/get_weight_version` (releases that
still have it) and `/get_weights_by_name`, each mirroring python/sglang/srt/entrypoints/http_server.py's handler of
that name in the release the fake speaks (releases.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from sim.fake_sglang import validation as v
from sim.fake_sglang.engine import Engine
from sim.fake_sglang.hf_names import checkpoint_named_tensors
from sim.fake_sglang.releases import has_update_sessions, model_info_extras

# python/sglang/srt/models/*.py: the model classes that define `get_weights_by_name` (llama.py, granite.py,
# exaone4.py, opt.py; Phi3, InternLM3, IQuestCoder derive from LlamaForCausalLM). Others — Qwen2 among them — have
# none: model_runner_components/weight_exporter.py catches the AttributeError and answers None, which the handler
# turns into a 400 (recorded from 0.5.17 serving Qwen2ForCausalLM).
_GET_WEIGHTS_BY_NAME = {
    "LlamaForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM", "IQuestCoderForCausalLM", "GraniteForCausalLM",
    "Exaone4ForCausalLM", "OPTForCausalLM",
}  # fmt: skip


def hf_config(engine: Engine, model_path: str | None) -> dict[str, Any]:
    """The served model's HF config as a dict: the `hf` engine's model's, else the checkpoint's config.json."""
    model = getattr(engine, "model", None)
    if model is not None and hasattr(model, "config"):
        return model.config.to_dict()
    path = Path(model_path or "") / "config.json"
    try:
        return json.loads(path.read_text()) if model_path and path.is_file() else {}
    except (OSError, ValueError):
        return {}


# python/sglang/srt/utils/hf_transformers/common.py `CONTEXT_LENGTH_KEYS`, in SGLang's order of preference
_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")


def context_length(config: dict[str, Any], override: int | None = None) -> int | None:
    """The context length SGLang serves a model with: `--context-length`, else `get_context_length(hf_config)`
    (common.py): the first of `_CONTEXT_KEYS`, times the rope-scaling factor unless the scaling keeps the
    original length. None for a config that names none (the synthetic engine has no model)."""
    if override:
        return int(override)
    scaling = config.get("rope_scaling") or {}
    factor = scaling.get("factor", 1) if isinstance(scaling, dict) else 1
    if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
        factor = 1
    return next((int(factor * config[k]) for k in _CONTEXT_KEYS if config.get(k) is not None), None)


def embedding_plan(server_args: dict[str, Any]) -> dict[str, Any]:
    """configs/embedding_model_spec.py `resolved_embedding_plan` for a causal LM (the NONE spec that
    `resolve_embedding_model_spec` gives unknown architectures) with the recorded server's prefill-graph defaults."""
    sizes = [4, 8, 12, 16, 20, 24, 28, 32] + list(range(48, 257, 16)) + list(range(288, 513, 32))
    sizes += list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, 8193, 512))
    return {
        "family": "none", "task": "none", "execution": "none", "attention": "none", "pooling": "model_defined",
        "normalize": False, "postprocessor": "none", "tokenizer_special_tokens": "model_default",
        "supports_dimensions": False, "supports_token_embeddings": False, "supports_multimodal": False,
        "requires_embedding_flag": False, "auto_enable_embedding": False, "bcg_eligibility": "disabled",
        "safe_disable_kv_cache": False, "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False,
        "enabled": False, "matryoshka_dimensions": [],
        "bcg": {"prefill_backend": "disabled", "enabled": False, "capture_token_budget": 8192,
                "capture_batch_sizes": sizes},
        "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False, "chunked_prefill_disabled": False},
    }  # fmt: skip


def register_info_routes(app: web.Application, engine: Engine, state: dict[str, Any]) -> None:
    version = state["version"]
    extras = model_info_extras(version)

    async def model_info(request: web.Request) -> web.Response:
        # http_server.py `model_info` (the engine's weight version is read here: 0.5.21+ has no /get_weight_version)
        sa = state["server_args"]
        cfg = hf_config(engine, sa.get("model_path"))
        info: dict[str, Any] = {"model_path": sa.get("model_path")}
        if "served_model_name" in extras:
            info["served_model_name"] = sa.get("served_model_name")
        info.update(
            tokenizer_path=sa.get("tokenizer_path"),
            is_generation=True,
            preferred_sampling_params=None,
            weight_version=engine.weight_version,
        )
        if "load_format" in extras:
            info.update(load_format="auto", reasoning_parser=None, tool_call_parser=None)
        if "disaggregation_mode" in extras:
            info["disaggregation_mode"] = sa.get("disaggregation_mode") or "null"
        info.update(
            has_image_understanding=False,
            has_audio_understanding=False,
            model_type=cfg.get("model_type"),
            architectures=cfg.get("architectures"),
        )
        if "embedding" in extras:
            info["embedding"] = embedding_plan(sa)
        return web.json_response(info)

    async def server_info(request: web.Request) -> web.Response:
        # http_server.py: get_server_info = server args + scheduler info + internal_states + version.
        sa = dict(state["server_args"], weight_version=engine.weight_version)
        internal = {
            "engine": engine.name,
            "paused": engine.paused,
            "released_tags": sorted(engine.released_tags),
            "num_running_reqs": len(engine.running),
            "num_waiting_reqs": len(engine.waiting),
            "decode_steps": engine.steps,
        }
        return web.json_response({**sa, "internal_states": [internal], "version": version})

    async def v1_models(request: web.Request) -> web.Response:
        # http_server.py `available_models`: a ModelList of one ModelCard (openai/protocol.py)
        sa = state["server_args"]
        name = str(sa.get("served_model_name") or sa.get("model_path") or "default")
        ctx = engine.context_len  # the tokenizer manager's model_config.context_len
        card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
                "parent": None, "max_model_len": ctx}  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    async def removed_weight_version(request: web.Request) -> web.Response:
        # http_server.py (0.5.14-0.5.20): the route raises HTTPException(404), which SGLang's HTTPException handler
        # renders as ErrorResponse (recorded from 0.5.17)
        detail = "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
        return v.http_exception(404, detail)

    async def get_weights_by_name(request: web.Request) -> web.Response:
        # http_server.py `get_weights_by_name`: GetWeightsByNameReqInput{name, truncate_size=100}; the model's
        # `get_weights_by_name` answers `param.float().tolist()[:truncate_size]` (llama.py), None on any failure
        body = v.GET_WEIGHTS_BY_NAME.validate(await v.read_body(request))
        arch = (hf_config(engine, state["server_args"].get("model_path")).get("architectures") or [None])[0]
        model = getattr(engine, "model", None)
        values = None
        if model is not None and arch in _GET_WEIGHTS_BY_NAME:
            named = dict(checkpoint_named_tensors(list(model.state_dict().items())))
            t = named.get(body["name"])
            if t is not None:
                with torch.no_grad():
                    values = t.detach().cpu().to(torch.float32).numpy().tolist()[: body["truncate_size"]]
        if values is None:
            return v.error_message("Get parameter by name failed")
        return web.json_response(values)

    r = app.router
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, model_info)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, server_info)
    r.add_get("/v1/models", v1_models)
    if not has_update_sessions(version):
        r.add_get("/get_weight_version", removed_weight_version)
        r.add_get("/weight_version", removed_weight_version)
    r.add_get("/get_weights_by_name", get_weights_by_name)
    r.add_post("/get_weights_by_name", get_weights_by_name)
