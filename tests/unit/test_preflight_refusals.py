"""Every refusal about the user's files and hooks is raised before Ray: by the parser or by `preflight`.

The cases are bad `--sglang-config` files (the loader's whole table of malformed YAML), hooks that do not import,
name no attribute or do not fit slime's call, and checkpoints the megatron backend cannot build. The walk at the
end reads every `raise` of a refusal in the modules that own these checks and asserts some case reached it, so a
new refusal there without a before-Ray case fails here. The CLI prints each as one line with no traceback
(subprocess runs of `slime train` at the end).
"""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

import slime.backends.megatron.checkpoint_checks as checkpoint_checks
import slime.backends.megatron.hf_config as hf_config
import slime.backends.sglang.sglang_config as sglang_config
import slime.utils.hook_checks as hook_checks
from slime.arguments import parse_args
from slime.train import preflight
from slime.utils.errors import SlimeArgError
from tests.unit.test_sglang_config import MALFORMED

pytestmark = pytest.mark.cpu

QWEN2 = {
    "model_type": "qwen2", "vocab_size": 64, "num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 128,
}  # fmt: skip
QWEN2_MOE = {**QWEN2, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 8, "norm_topk_prob": True}  # fmt: skip
GLM4_MOE = {**QWEN2, "model_type": "glm4_moe", "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "first_k_dense_replace": 1, "n_shared_experts": 1}  # fmt: skip
MODULE = __name__  # hooks below are imported by path, as a user's would be
CHECKED = [sglang_config, hf_config, hook_checks, checkpoint_checks]
REACHED: set[tuple[str, int]] = set()  # (file, line of the raise) of every refusal a case produced


# ---- hooks with the wrong shapes --------------------------------------------------------------------------------
def rm_wrong(sample):  # slime calls fn(args, sample)
    return 0.0


not_a_function = 3


def _raise_on_import_module(tmp: Path) -> str:
    (tmp / "broken_hook_mod.py").write_text("raise RuntimeError('boom at import')\n")
    return "broken_hook_mod.fn"


# ---- the run --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preflight")
    data = tmp / "train.jsonl"
    data.write_text('{"input": "a", "label": "1"}\n{"input": "b", "label": "2"}\n')
    sys.path.insert(0, str(tmp))
    yield tmp, str(data)
    sys.path.remove(str(tmp))


def checkpoint(tmp: Path, name: str, cfg: dict | str) -> str:
    d = tmp / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(d)


def base_argv(tmp: Path, data: str, model: str | None = None) -> list[str]:
    return ["--hf-checkpoint", model or checkpoint(tmp, "qwen2", QWEN2), "--prompt-data", data, "--num-rollout", "1",
            "--rollout-batch-size", "1", "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "2",
            "--rollout-engine", "sim"]  # fmt: skip


def refusal(argv: list[str]) -> tuple[str, SlimeArgError]:
    """('parse' | 'preflight', the error): which step before Ray refused `argv`. Records where it was raised.

    Hooks are imported in a child process, so for a hook refusal the same check runs here too
    (`check_hook_list`, what the child runs) to learn its raise site; the two messages must be equal."""
    try:
        args = parse_args(argv)
    except SlimeArgError as e:
        _record(e)
        return "parse", e
    with pytest.raises(SlimeArgError) as info:
        preflight(args)
    _record(info.value)
    if str(info.value).startswith("checking the hooks failed"):
        return "preflight", info.value  # the hook killed its importer: never import it here
    try:
        hook_checks.check_hook_list(hook_checks.hook_paths(args))
    except SlimeArgError as e:
        if str(e) == str(info.value):
            _record(e)
    return "preflight", info.value


def _record(e: BaseException | None) -> None:
    files = {os.path.abspath(m.__file__) for m in CHECKED}
    while e is not None:  # the error and the one it replaced (`raise ... from None` keeps it as __context__)
        tb, site = e.__traceback__, None
        while tb is not None:
            if os.path.abspath(tb.tb_frame.f_code.co_filename) in files:
                site = (os.path.abspath(tb.tb_frame.f_code.co_filename), tb.tb_lineno)
            tb = tb.tb_next
        if site:
            REACHED.add(site)
        e = e.__context__


GROUP = "{num_gpus: 8}"
MORE_YAML = [  # refusals the loader's own table does not reach
    ("{}\n", {}, "sglang: required top-level key missing"),
    ("sglang:\n  - {name: a, server_groups: [{worker_type: encoder, num_gpus: 8}]}\n", {}, "encoder groups (EPD)"),
    ("sglang:\n  - {name: a, sim: {engine: turbo}, server_groups: [" + GROUP + "]}\n", {}, "unknown fake engine 'turbo'"),
]  # fmt: skip
YAML_CASES = MALFORMED + MORE_YAML
# the parser refuses these flags with --sglang-config before the loader sees the file: its message differs
PARSER_FIRST = {"rollout_external": "--rollout-external excludes --sglang-config"}


@pytest.mark.parametrize("text,extra,fragment", YAML_CASES, ids=[f"yaml{i}" for i in range(len(YAML_CASES))])
def test_every_bad_sglang_config_is_refused_before_ray(world, text, extra, fragment):
    tmp, data = world
    topo = tmp / f"topo{abs(hash(text)) % 10**8}.yaml"
    topo.write_text(text)
    flags = {"prefill_num_servers": ["--prefill-num-servers", "1"], "rollout_external": ["--rollout-external"],
             "rollout_num_gpus": []}  # fmt: skip
    argv = [*base_argv(tmp, data), "--sglang-config", str(topo)]
    for key in extra:
        argv += flags[key]
    if "rollout_external" in extra:
        argv += ["--rollout-external-engine-addrs", "127.0.0.1:1"]
    where, e = refusal(argv)
    fragment = next((PARSER_FIRST[k] for k in extra if k in PARSER_FIRST), fragment)
    assert fragment in str(e) and "\n" not in str(e), (where, str(e))


def test_a_model_reference_missing_from_the_config_is_refused_before_ray(world):
    tmp, data = world
    topo = tmp / "one_model.yaml"
    topo.write_text("sglang:\n  - {name: actor, server_groups: [{num_gpus: 8}]}\n")
    argv = [*base_argv(tmp, data), "--sglang-config", str(topo)]
    assert "no such model" in str(refusal([*argv, "--ref-model-name", "ref", "--use-kl-loss"])[1])
    assert "receives the actor's weights" in str(refusal([*argv, "--ref-model-name", "actor", "--use-kl-loss"])[1])
    # no YAML: the flags' own topology is checked too
    assert "leaves no decode GPUs" in str(refusal([*base_argv(tmp, data), "--prefill-num-servers", "4"])[1])


HOOK_CASES = [
    ("--custom-rm-path", "no_such_pkg.reward", "cannot import module 'no_such_pkg'"),
    ("--custom-rm-path", f"{MODULE}.rm_wrnog", "has no attribute 'rm_wrnog'; did you mean 'rm_wrong'?"),
    ("--custom-rm-path", f"{MODULE}.rm_wrong", "does not fit slime's call"),
    ("--custom-rm-path", f"{MODULE}.not_a_function", "is a int, not a function"),
    ("--custom-rm-path", "reward", "an import path looks like"),
    ("--custom-loss-function-path", f"{MODULE}.rm_wrong", "rm_wrong(sample) does not fit slime's call"),
    ("--custom-megatron-before-train-step-hook-path", f"{MODULE}.rm_wrong", "step_id"),
    ("--custom-tis-function-path", f"{MODULE}.rm_wrong", "train_log_probs"),
    ("--data-source-path", f"{MODULE}.no_source", "has no attribute"),
    ("--rollout-function-path", f"{MODULE}.rm_wrong", "does not fit"),
]


@pytest.mark.parametrize("flag,path,fragment", HOOK_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(HOOK_CASES)])
def test_every_hook_is_imported_and_its_signature_checked_before_ray(world, flag, path, fragment):
    tmp, data = world
    where, e = refusal([*base_argv(tmp, data), flag, path])
    assert where == "preflight" and fragment in str(e) and str(e).startswith(f"{flag} {path}: "), str(e)


def test_a_hook_that_raises_while_importing_is_one_line(world):
    tmp, data = world
    path = _raise_on_import_module(tmp)
    where, e = refusal([*base_argv(tmp, data), "--custom-rm-path", path])
    assert where == "preflight" and "raised RuntimeError: boom at import" in str(e)


def test_a_hook_that_kills_its_importer_is_one_line(world):
    tmp, data = world
    (tmp / "exit_hook_mod.py").write_text("import os\nos._exit(3)\n")
    where, e = refusal([*base_argv(tmp, data), "--custom-rm-path", "exit_hook_mod.fn"])
    assert where == "preflight" and str(e).startswith("checking the hooks failed (rc 3)"), str(e)


def test_a_role_override_hook_is_checked(world):
    tmp, data = world
    roles = tmp / "roles.yaml"
    roles.write_text(
        f"megatron:\n  - {{name: default, role: actor, overrides: {{custom_megatron_before_train_step_hook_path: {MODULE}.no_hook}}}}\n"
    )
    where, e = refusal([*base_argv(tmp, data), "--megatron-config", str(roles)])
    assert where == "preflight" and str(e).startswith(
        "--megatron-config actor: custom_megatron_before_train_step_hook_path"
    ), str(e)


CHECKPOINT_CASES = [
    ({**QWEN2, "model_type": "gemma"}, [], "model_type 'gemma' is not supported"),
    ({**QWEN2, "hidden_act": "gelu"}, [], "hidden_act 'gelu'"),
    ({**QWEN2, "mlp_bias": True}, [], "mlp_bias"),
    ({**QWEN2, "use_sliding_window": True}, [], "sliding-window"),
    ({k: v for k, v in QWEN2.items() if k != "num_attention_heads"}, [], "config.json has no 'num_attention_heads'"),
    ("{not json", [], "cannot read"),
    (QWEN2, ["--tensor-model-parallel-size", "3"], "must divide num_attention_heads"),
    ({k: v for k, v in QWEN2_MOE.items() if k != "num_experts"}, [], "has no num_experts"),
    ({**QWEN2_MOE, "num_experts_per_tok": 9}, [], "num_experts_per_tok 9"),
    ({**QWEN2_MOE, "mlp_only_layers": [0, 1]}, [], "MoE config without a sparse layer"),
    ({**GLM4_MOE, "n_routed_experts": 0}, [], "glm4_moe config has no n_routed_experts"),
    ({**GLM4_MOE, "num_experts_per_tok": 5}, [], "num_experts_per_tok 5"),
    ({**GLM4_MOE, "n_group": 2, "topk_group": 1}, [], "n_group > 1"),
    ({**GLM4_MOE, "norm_topk_prob": False}, [], "needs norm_topk_prob true"),
    ({**GLM4_MOE, "first_k_dense_replace": 2}, [], "without a sparse layer (first_k_dense_replace)"),
    ({**QWEN2, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, [], "rope type 'longrope'"),
    ({**QWEN2, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ["--context-parallel-size", "2"],
     "dynamic RoPE scaling with --context-parallel-size"),
    ({**QWEN2_MOE, "num_experts_per_tok": 1}, [], "num_experts_per_tok 1 with norm_topk_prob"),
    (QWEN2_MOE, ["--expert-model-parallel-size", "3"], "must divide num_experts"),
    ({**QWEN2_MOE, "moe_intermediate_size": 7}, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
     "--expert-tensor-parallel-size", "2"], "expert"),
]  # fmt: skip


@pytest.mark.parametrize(
    "cfg,flags,fragment", CHECKPOINT_CASES, ids=[f"ckpt{i}" for i in range(len(CHECKPOINT_CASES))]
)
def test_every_architecture_check_runs_before_ray(world, cfg, flags, fragment):
    tmp, data = world
    model = checkpoint(tmp, f"ckpt{CHECKPOINT_CASES.index((cfg, flags, fragment))}", cfg)
    argv = base_argv(tmp, data, model)
    argv += ["--actor-num-gpus-per-node", "6", "--colocate", *flags]
    _, e = refusal(argv)
    assert fragment in str(e), str(e)


def test_a_checkpoint_without_config_json_is_refused(world):
    tmp, data = world
    empty = tmp / "no_config"
    empty.mkdir(exist_ok=True)
    assert "no config.json" in str(refusal(base_argv(tmp, data, str(empty)))[1])


def test_each_roles_checkpoint_is_read(world):
    tmp, data = world
    good = checkpoint(tmp, "good", QWEN2)
    bad = checkpoint(tmp, "bad_gemma", {**QWEN2, "model_type": "gemma"})
    argv = base_argv(tmp, data, good)
    roles = tmp / "critic_roles.yaml"
    roles.write_text(f"megatron:\n  - {{name: default, role: critic, overrides: {{hf_checkpoint: {bad}}}}}\n")
    where, e = refusal([*argv, "--advantage-estimator", "ppo", "--megatron-config", str(roles)])
    assert where == "preflight" and str(e).startswith("critic --hf-checkpoint"), str(e)
    empty = tmp / "critic_no_config"
    empty.mkdir(exist_ok=True)
    roles.write_text(f"megatron:\n  - {{name: default, role: critic, overrides: {{hf_checkpoint: {empty}}}}}\n")
    where, e = refusal([*argv, "--advantage-estimator", "ppo", "--megatron-config", str(roles)])
    assert where == "preflight" and str(e).startswith("critic --hf-checkpoint: no config.json"), str(e)
    where, e = refusal([*argv, "--use-kl-loss", "--ref-load", bad])
    assert where == "preflight" and str(e).startswith("--ref-load"), str(e)
    where, e = refusal([*argv, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", bad])
    assert where == "preflight" and str(e).startswith("--opd-teacher-load"), str(e)


# refusals of these modules that no file can reach, each with the check that comes first
NOT_FROM_A_FILE = {
    "excludes --rollout-external": "the parser refuses --rollout-external with --sglang-config (arguments.py)",
    "must divide num_experts": "validate_moe_args refuses it while parsing (backends/megatron/arguments.py)",
    "expert tensor parallel size": "validate_moe_args refuses ETP > 1 while parsing",
    '"expected a non-empty string"': "an empty overrides.model_path falls back to the model's path, checked before",
    "importing the hooks took over": "a hook whose import hangs for minutes (not worth a test that waits that long)",
    "is required (an HF checkpoint directory)": "the parser requires --hf-checkpoint; a role override of it to null "
    "is refused by --megatron-config's loader",
}


def _refusal_sites() -> set[tuple[str, int, int, str]]:
    """(file, first line, last line, source) of every `raise SlimeArgError(...)` / `ctx.error(...)` / `err(...)`."""
    out = set()
    for m in CHECKED:
        path = os.path.abspath(m.__file__)
        source = Path(path).read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                f = node.exc.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name in ("SlimeArgError", "error", "err"):
                    out.add((path, node.lineno, node.end_lineno or node.lineno, ast.get_source_segment(source, node)))
    return out


def test_walk_every_refusal_is_reached_by_a_case_before_ray(world):
    """Runs after the cases above (one file runs on one worker, in order: pyproject's --dist loadfile)."""
    if not REACHED:
        pytest.skip("run it with the cases of this module: it checks what they reached")
    missed = [
        f"{os.path.basename(p)}:{a}: {text[:80]}"
        for p, a, b, text in sorted(_refusal_sites())
        if not any(rp == p and a <= rl <= b for rp, rl in REACHED) and not any(k in text for k in NOT_FROM_A_FILE)
    ]
    assert not missed, f"refusals no before-Ray case reaches: {missed}"


# ---- the CLI: one line, no traceback, Ray never started ----------------------------------------------------------
CLI_CASES = [
    ("typo", "sglang:\n  - {name: a, server_groups: [{num_gpus: 8, num_gpu_per_engine: 2}]}\n", [],
     "did you mean 'num_gpus_per_engine'"),
    ("zero_gpus", "sglang:\n  - {name: a, server_groups: [{num_gpus: 0}]}\n", [], "num_gpus: expected a positive"),
    ("yaml_syntax", "sglang: [\n", [], "invalid YAML"),
    ("missing_rm", None, ["--custom-rm-path", "user_hooks.rm_wrnog"], "did you mean 'rm_wrong'?"),
    ("architecture", None, ["--tensor-model-parallel-size", "8"], "must divide num_attention_heads"),
]  # fmt: skip


@pytest.mark.parametrize("name,text,flags,needle", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_slime_train_prints_one_line_and_starts_nothing(tmp_path, name, text, flags, needle):
    from tests.unit.test_cli_errors import assert_one_line_and_nothing_started, run_slime

    data = tmp_path / "train.jsonl"
    data.write_text('{"input": "a", "label": "1"}\n')
    argv = base_argv(tmp_path, str(data))
    if text is not None:
        (tmp_path / "topo.yaml").write_text(text)
        argv += ["--sglang-config", str(tmp_path / "topo.yaml")]
    argv += flags
    (tmp_path / "user_hooks.py").write_text("def rm_wrong(args, sample):\n    return 0.0\n")
    with pytest.MonkeyPatch.context() as mp:  # the user's hook module, importable as theirs would be
        mp.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
        proc = run_slime(tmp_path, argv)
    assert_one_line_and_nothing_started(tmp_path, proc, needle)
