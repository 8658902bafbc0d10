"""Import every `--*-path` hook before Ray starts and check that slime can call it the way it will.

Why: a hook is otherwise imported where it first runs — a reward function inside the first rollout, a loss inside
the first train step — so a typo in a module or function name surfaced only after the cluster, the engines and a
rollout had started, as a Ray traceback. Here each hook is imported and its signature is bound to the arguments
slime passes (slime v0.3.0's calls, docs/architecture.md's hook table); a mismatch is one line.

The imports run in one short child process (`python -m slime.utils.hook_checks`, the driver's `sys.path`): a
train-side hook imports torch, which the driver never does (tests/unit/test_driver_imports.py). Hooks left at
slime's own defaults (`builtin`) are not re-checked; there is no child when no other hook is set.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import os
import subprocess
import sys
from argparse import Namespace
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from slime.utils.errors import SlimeArgError

HOOK_CHECK_TIMEOUT_S = 300


@dataclass(frozen=True)
class HookCall:
    """How slime calls one hook: its positional arguments (by name, for the message) and its keyword arguments."""

    positional: tuple[str, ...]
    keywords: tuple[str, ...] = ()

    def describe(self, name: str) -> str:
        return f"{name}({', '.join([*self.positional, *(f'{k}=...' for k in self.keywords)])})"


# dest -> the call slime makes (the call sites: rollout/, ray/rollout_manager.py, ray/train_data.py,
# algorithms/loss.py, algorithms/advantages.py, backends/megatron/{trainer,initialize}.py)
HOOK_CALLS: dict[str, HookCall] = {
    "rollout_function_path": HookCall(("args", "rollout_id", "data_source"), ("evaluation",)),
    "eval_function_path": HookCall(("args", "rollout_id", "data_source"), ("evaluation",)),
    "custom_generate_function_path": HookCall(("args", "sample", "sampling_params")),
    "dynamic_sampling_filter_path": HookCall(("args", "samples")),
    "buffer_filter_path": HookCall(("args", "rollout_id", "buffer", "num_samples")),
    "rollout_sample_filter_path": HookCall(("args", "samples")),
    "rollout_all_samples_process_path": HookCall(("args", "all_samples", "data_source")),
    "rollout_data_postprocess_path": HookCall(("args", "rollout_id", "rollout_data")),
    "data_source_path": HookCall(("args",)),
    "custom_rm_path": HookCall(("args", "sample_or_samples")),
    "custom_reward_post_process_path": HookCall(("args", "samples")),
    "custom_convert_samples_to_train_data_path": HookCall(("args", "samples")),
    "custom_async_data_buffer_path": HookCall(("args", "capacity")),
    "custom_loss_function_path": HookCall(("args", "batch", "logits", "sum_of_sample_mean")),
    "custom_advantage_function_path": HookCall(("args", "rollout_data")),
    "custom_tis_function_path": HookCall(
        (),
        ("args", "pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks", "total_lengths", "response_lengths"),
    ),
    "custom_pg_loss_reducer_function_path": HookCall(
        ("total_lengths", "response_lengths", "loss_masks", "calculate_per_token_loss")
    ),
    "custom_rollout_log_function_path": HookCall(("rollout_id", "args", "samples", "extra", "rollout_time")),
    "custom_eval_rollout_log_function_path": HookCall(("rollout_id", "args", "data", "extra")),
    "custom_megatron_init_path": HookCall(("args",)),
    "custom_megatron_before_log_prob_hook_path": HookCall(("args", "model", "store_prefix")),
    "custom_megatron_before_train_step_hook_path": HookCall(
        ("args", "rollout_id", "step_id", "model", "optimizer", "scheduler")
    ),
}


def flag_of(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_hook(flag: str, path: str, call: HookCall) -> Callable[..., Any]:
    """Import `path`; raise SlimeArgError unless it is callable the way `call` says."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise SlimeArgError(f"{flag} {path}: an import path looks like 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SlimeArgError(f"{flag} {path}: cannot import module {module_name!r} ({e})") from None
    except Exception as e:  # the module raised while importing: that is the user's code, name it in one line
        raise SlimeArgError(f"{flag} {path}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        close = difflib.get_close_matches(attr, [n for n in dir(module) if not n.startswith("_")], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise SlimeArgError(f"{flag} {path}: module {module_name!r} has no attribute {attr!r}{hint}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise SlimeArgError(f"{flag} {path}: is a {type(fn).__name__}, not a function or class")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin or C callable without a signature: nothing to check
    try:
        sig.bind(*call.positional, **dict.fromkeys(call.keywords))
    except TypeError as e:
        bare = sig.replace(
            parameters=[q.replace(annotation=inspect.Parameter.empty) for q in sig.parameters.values()],
            return_annotation=inspect.Signature.empty,
        )
        raise SlimeArgError(
            f"{flag} {path}: its signature {attr}{bare} does not fit slime's call {call.describe(attr)} ({e})"
        ) from None
    return fn


def hook_paths(args: Namespace) -> list[tuple[str, str, str]]:
    """(flag, dest, import path) of every hook the run will call: the flags' and each role's overrides."""
    out = [(flag_of(dest), dest, vars(args)[dest]) for dest in HOOK_CALLS if vars(args)[dest]]
    for role, overrides in args.role_overrides.items():
        for dest, value in overrides.items():
            if dest in HOOK_CALLS and value:
                out.append((f"--megatron-config {role}: {dest}", dest, value))
    return out


def check_hook_list(hooks: list[tuple[str, str, str]]) -> None:
    """In this process: every (flag, dest, path) imports and fits its call, else SlimeArgError for the first."""
    for flag, dest, path in hooks:
        check_hook(flag, path, HOOK_CALLS[dest])


def check_hooks(args: Namespace, builtin: Collection[str] = ()) -> None:
    """Every hook the user set imports and fits its call (in a child process); one-line SlimeArgError if not.

    `builtin`: slime's own default paths, tested with slime itself and not re-imported."""
    hooks = [h for h in hook_paths(args) if h[2] not in builtin]
    if not hooks:
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", __name__], input=json.dumps(hooks), capture_output=True, text=True, env=env,
            timeout=HOOK_CHECK_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise SlimeArgError(
            f"importing the hooks took over {HOOK_CHECK_TIMEOUT_S} s: {[h[2] for h in hooks]}"
        ) from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SlimeArgError(f"checking the hooks failed (rc {proc.returncode}): {proc.stderr.strip()[-500:]}")
    error = json.loads(lines[-1])["error"]
    if error:
        raise SlimeArgError(error)


def _main() -> None:
    hooks = [tuple(h) for h in json.loads(sys.stdin.read())]
    try:
        check_hook_list(hooks)  # type: ignore[arg-type]
        error = None
    except SlimeArgError as e:
        error = str(e)
    sys.stdout.write("\n" + json.dumps({"error": error}) + "\n")  # last line: a hook may print while importing


if __name__ == "__main__":
    _main()
