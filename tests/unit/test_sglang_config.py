"""`--sglang-config` loader: how engine sizes and update_weights resolve (group, then model, then the flags), and
one-line errors (file, YAML path, line)."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

import pytest

from slime.arguments import default_args
from slime.backends.sglang.sglang_config import config_from_flags, load_sglang_config
from slime.cli import main as slime_main
from slime.utils.errors import SlimeArgError

pytestmark = pytest.mark.cpu

HF = "/ckpt/policy"


def topo_args(**kw: Any) -> argparse.Namespace:
    """8 rollout GPUs in engines of 2 serving HF (the parser's defaults otherwise: 8 GPUs per node, no PD)."""
    return default_args(**{"hf_checkpoint": HF, "rollout_num_gpus": 8, "rollout_num_gpus_per_engine": 2, **kw})


def write(tmp_path, text: str):
    p = tmp_path / "topo.yaml"
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    return p


def test_resolution_rules(tmp_path):
    p = write(
        tmp_path,
        """
        sglang:
          - name: actor
            num_gpus_per_engine: 4
            server_groups:
              - {worker_type: prefill, num_gpus: 2, num_gpus_per_engine: 1, overrides: {mem-fraction-static: 0.7}}
              - {worker_type: decode, num_gpus: 4}
          - name: ref
            model_path: /ckpt/ref
            engine_groups:
              - {num_gpus: 2, overrides: {model_path: /ckpt/ref}}
        """,
    )
    cfg = load_sglang_config(str(p), topo_args())
    actor, ref = cfg.models
    # engine size: group (1) -> model (4) -> --rollout-num-gpus-per-engine (2)
    assert [g.num_gpus_per_engine for g in actor.server_groups] == [1, 4]
    assert ref.server_groups[0].num_gpus_per_engine == 2
    assert actor.server_groups[0].overrides == {"mem_fraction_static": 0.7}  # dash keys normalised
    assert actor.is_pd and not ref.is_pd and actor.model_path == HF
    # update_weights auto: true iff the model serves --hf-checkpoint; only the first such model is synced
    assert actor.update_weights and actor.receives_weights
    assert not ref.update_weights and not ref.receives_weights
    assert cfg.weight_sync_model is actor and cfg.num_gpus == 8


def test_only_first_update_weights_model_is_synced(tmp_path):
    p = write(
        tmp_path,
        """
        sglang:
          - {name: a, server_groups: [{num_gpus: 4}]}
          - {name: b, server_groups: [{num_gpus: 4}]}
        """,
    )
    a, b = load_sglang_config(str(p), topo_args()).models
    assert a.update_weights and b.update_weights  # both serve --hf-checkpoint (auto)
    assert a.receives_weights and not b.receives_weights


def test_flags_without_yaml():
    cfg = config_from_flags(topo_args())
    assert [(g.worker_type, g.num_gpus) for g in cfg.models[0].server_groups] == [("regular", 8)]
    legacy = config_from_flags(topo_args(prefill_num_servers=1))
    assert [(g.worker_type, g.num_gpus) for g in legacy.models[0].server_groups] == [("prefill", 2), ("decode", 6)]


GOOD_GROUP = "{num_gpus: 8}"
# (yaml text, extra args, fragment the one-line error must contain (YAML path and/or line))
MALFORMED = [
    ("sglang: [", {}, "invalid YAML"),
    ("sglang:\n  - name: a\n   server_groups: []\n", {}, ":3: invalid YAML"),
    ("", {}, "empty"),
    ("models: []\n", {}, ":1: models: unknown key"),
    ("sglang: {name: a}\n", {}, "sglang: expected a list"),
    ("sglang: []\n", {}, "sglang: must not be empty"),
    ("sglang:\n  - 5\n", {}, ":2: sglang[0]: expected a mapping"),
    ("sglang:\n  - server_groups: [" + GOOD_GROUP + "]\n", {}, "sglang[0].name: required"),
    ("sglang:\n  - {name: 3, server_groups: [" + GOOD_GROUP + "]}\n", {}, "sglang[0].name: expected a non-empty string"),
    ("sglang:\n  - {name: a}\n", {}, "sglang[0].server_groups: required"),
    ("sglang:\n  - {name: a, server_groups: []}\n", {}, "sglang[0].server_groups: must not be empty"),
    ("sglang:\n  - {name: a, server_groups: [" + GOOD_GROUP + "], engine_groups: [" + GOOD_GROUP + "]}\n", {},
     "sglang[0].engine_groups: give server_groups or its alias"),
    ("sglang:\n  - {name: a, severs: 1, server_groups: [" + GOOD_GROUP + "]}\n", {}, "sglang[0].severs: unknown key"),
    ("sglang:\n  - {name: a, update_weights: yes-please, server_groups: [" + GOOD_GROUP + "]}\n", {},
     "sglang[0].update_weights: expected true or false"),
    ("sglang:\n  - {name: a, num_gpus_per_engine: two, server_groups: [" + GOOD_GROUP + "]}\n", {},
     "sglang[0].num_gpus_per_engine: expected a positive integer"),
    ("sglang:\n  - name: a\n    server_groups:\n      - {worker_type: turbo, num_gpus: 8}\n", {},
     ":4: sglang[0].server_groups[0].worker_type: unknown worker_type 'turbo'"),
    ("sglang:\n  - {name: a, server_groups: [{worker_type: regular}]}\n", {}, "server_groups[0].num_gpus: required"),
    ("sglang:\n  - {name: a, server_groups: [{num_gpus: -8}]}\n", {}, "server_groups[0].num_gpus: expected a positive"),
    ("sglang:\n  - {name: a, server_groups: [{num_gpus: 8.5}]}\n", {}, "server_groups[0].num_gpus: expected a positive"),
    ("sglang:\n  - {name: a, server_groups: [{num_gpus: 8, num_gpu_per_engine: 2}]}\n", {},
     "server_groups[0].num_gpu_per_engine: unknown key; did you mean 'num_gpus_per_engine'"),
    ("sglang:\n  - {name: a, server_groups: [{num_gpus: 6}]}\n", {}, ":2: sglang: server groups use 6 GPUs"),
    ("sglang:\n  - {name: a, server_groups: [{num_gpus: 8, num_gpus_per_engine: 3}]}\n", {},
     "server_groups[0].num_gpus: 8 GPUs is not a multiple of 3"),
    ("sglang:\n  - name: a\n    server_groups:\n      - num_gpus: 8\n        overrides:\n          mem_fraction: 0.5\n",
     {}, ":6: sglang[0].server_groups[0].overrides.mem_fraction: unknown SGLang server arg"),
    ("sglang:\n  - {name: a, server_groups: [{num_gpus: 8, overrides: [1, 2]}]}\n", {},
     "server_groups[0].overrides: expected a mapping"),
    ("sglang:\n  - {name: a, server_groups: [{num_gpus: 8, overrides: {tp_size: 4}}]}\n", {},
     "overrides.tp_size: override 'tp_size' is not allowed"),
    ("sglang:\n  - {name: a, server_groups: [{num_gpus: 4}]}\n  - {name: a, server_groups: [{num_gpus: 4}]}\n", {},
     ":3: sglang[1].name: duplicate model name 'a'"),
    ("sglang:\n  - {name: a, update_weights: true, server_groups: [{num_gpus: 4}]}\n"
     "  - {name: b, update_weights: true, server_groups: [{num_gpus: 4}]}\n", {},
     ":3: sglang[1].update_weights: models 'a' and 'b' both set update_weights"),
    ("sglang:\n  - name: a\n    server_groups:\n      - {worker_type: regular, num_gpus: 4}\n"
     "      - {worker_type: decode, num_gpus: 4}\n", {}, "regular and prefill/decode groups cannot be mixed"),
    ("sglang:\n  - {name: a, server_groups: [{worker_type: decode, num_gpus: 8}]}\n", {},
     "a PD model needs both prefill and decode groups; prefill is missing"),
    ("sglang:\n  - {name: a, server_groups: [{worker_type: placeholder, num_gpus: 8}]}\n", {},
     "sglang[0].server_groups: the model has only placeholder groups"),
    ("sglang:\n  - name: a\n    server_groups:\n      - {num_gpus: 4, overrides: {model_path: /x}}\n"
     "      - {num_gpus: 4}\n", {}, "all groups of one model must serve one model path"),
    ("sglang:\n  - {name: a, server_groups: [" + GOOD_GROUP + "]}\n", {"prefill_num_servers": 1},
     "excludes --prefill-num-servers"),
    ("sglang:\n  - {name: a, server_groups: [" + GOOD_GROUP + "]}\n", {"rollout_external": True},
     "excludes --rollout-external"),
    ("sglang:\n  - {name: a, server_groups: [{num_gpus: 8, num_gpus_per_engine: 12}]}\n", {"rollout_num_gpus": 8},
     "must be a multiple of --num-gpus-per-node"),
    ("sglang:\n  - name: a\n    name: b\n    server_groups: [" + GOOD_GROUP + "]\n", {}, ":3: sglang[0].name: duplicate key"),
]  # fmt: skip


@pytest.mark.parametrize("text,extra,fragment", MALFORMED, ids=[f"bad{i}" for i in range(len(MALFORMED))])
def test_malformed_config_is_one_line_error(tmp_path, text, extra, fragment):
    p = tmp_path / "topo.yaml"
    p.write_text(text)
    with pytest.raises(SlimeArgError) as e:
        load_sglang_config(str(p), topo_args(**extra))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--sglang-config {p}")
    assert fragment in msg, msg


def test_cli_prints_one_line_without_traceback(tmp_path, capsys):
    p = tmp_path / "topo.yaml"
    p.write_text(MALFORMED[22][0])  # the unknown SGLang flag
    rc = slime_main(["plan", "--sglang-config", str(p), "--rollout-num-gpus", "8", "--hf-checkpoint", HF])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "sglang[0].server_groups[0].overrides.mem_fraction" in err and ":6:" in err
