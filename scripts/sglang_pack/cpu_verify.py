"""CPU-side check of the offline SGLang pack: import closure, CLI and server-args parsing, without a GPU.

Build-machine tool only (it is not copied into the pack). Run it through the pack's interpreter wrapper:

    .sgl-site/bin/python scripts/sglang_pack/cpu_verify.py [--model DIR] [--walk] [--json OUT]

It pretends to be one H200 (`torch.cuda.is_available()` and friends answer as on the GPU host) so that sglang
takes its CUDA import branches; nothing of this is in the pack. A stand-in `libcuda.so.1` (the driver API)
may be put on LD_LIBRARY_PATH by the caller so that sgl_kernel's compiled ops load against the real torch.

Steps: (1) import the serving-path modules; (2) with --walk, a fixpoint over every `sglang.*` module that the
loaded sglang modules name anywhere (lazy imports inside functions too), importing each and grouping the
failures by the missing top-level module; (3) with --model, `prepare_server_args` on the first-try flags;
(4) which distributions of the pack were loaded and which were never imported.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import sys
import traceback
import types

SERVING_MODULES = [
    "sglang.launch_server",
    "sglang.srt.server_args",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.entrypoints.openai.serving_chat",
    "sglang.srt.entrypoints.openai.serving_completions",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_loader.loader",
    "sglang.srt.models.qwen2",
    "sglang.srt.models.qwen3",
    "sglang.srt.models.llama",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.sampler",
    "sglang.srt.layers.layernorm",
    "sglang.srt.layers.activation",
    "sglang.srt.constrained.xgrammar_backend",
    "sglang.srt.weight_sync.utils",
    "sglang.srt.weight_sync.tensor_bucket",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.kernels.ops.activation.activation",
    "sglang.kernels.ops.attention.rope",
    "sglang.kernels.ops.kvcache.kvcache",
    "sgl_kernel",
    "flashinfer",
    "xgrammar",
    "torch_memory_saver",
]

FIRST_TRY_FLAGS = [
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--enable-memory-saver",
    "--mem-fraction-static",
    "0.3",
]


def fake_h200() -> None:
    """Make torch answer like a host with one H200, for import-time branches only (no kernel can run)."""
    import torch

    props = types.SimpleNamespace(
        name="NVIDIA H200",
        major=9,
        minor=0,
        total_memory=143771 << 20,
        multi_processor_count=132,
        gcnArchName="",
        uuid="GPU-00000000-0000-0000-0000-000000000000",
        L2_cache_size=50 << 20,
    )
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.get_device_name = lambda *a, **k: props.name
    cuda.get_device_properties = lambda *a, **k: props
    cuda.mem_get_info = lambda *a, **k: (props.total_memory - (1 << 30), props.total_memory)
    cuda.is_bf16_supported = lambda *a, **k: True
    cuda.synchronize = lambda *a, **k: None
    cuda._lazy_init = lambda: None


def try_import(name: str) -> str | None:
    try:
        importlib.import_module(name)
        return None
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from import-time code count too
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def referenced_sglang_modules(path: str, own: str) -> set[str]:
    """Every `sglang.*` module that the source at `path` (module `own`) imports anywhere, lazily too."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return set()
    out: set[str] = set()
    pkg = own if path.endswith("__init__.py") else own.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "sglang")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "sglang":
                continue
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return out


def is_module(name: str) -> bool:
    """False for `pkg.attr` (a name imported from a module, not a submodule); True when unsure."""
    parent = sys.modules.get(name.rpartition(".")[0])
    if parent is not None and not hasattr(parent, "__path__"):
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except BaseException:  # noqa: BLE001 - a parent package failing to import: let the import attempt report it
        return True


def walk(report: dict) -> None:
    seen: set[str] = set()
    failures: dict[str, str] = {}
    while True:
        frontier: set[str] = set()
        for name, mod in list(sys.modules.items()):
            if not name.startswith("sglang") or name in seen or getattr(mod, "__file__", None) is None:
                continue
            seen.add(name)
            frontier |= referenced_sglang_modules(mod.__file__, name)
        frontier = {m for m in frontier if m not in sys.modules and m not in failures and is_module(m)}
        if not frontier:
            break
        for m in sorted(frontier):
            err = try_import(m)
            parent = m.rpartition(".")[0]
            if err and ("is not a package" in err or (f"'{m}'" in err and parent in sys.modules)):
                continue  # `from pkg import name` where name is an attribute of an importable pkg
            if err:
                failures[m] = err
    by_cause: dict[str, list[str]] = collections.defaultdict(list)
    for m, err in failures.items():
        cause = err
        if "No module named" in err:
            cause = "missing " + err.split("No module named", 1)[1].strip(" '\"").split("'")[0].split(".")[0]
        by_cause[cause].append(m)
    report["walk"] = {
        "imported_sglang_modules": sum(1 for n in sys.modules if n.startswith("sglang")),
        "failed": len(failures),
        "by_cause": {k: sorted(v) for k, v in sorted(by_cause.items(), key=lambda kv: -len(kv[1]))},
    }


def pack_distributions(site: str, report: dict) -> None:
    """Which of the pack's distributions had a module loaded, and which none."""
    loaded_files = {os.path.realpath(getattr(m, "__file__", "") or "") for m in list(sys.modules.values())}
    used, unused = [], []
    for dist in md.distributions(path=[site]):
        files = [os.path.realpath(os.path.join(site, str(f))) for f in (dist.files or ())]
        name = f"{dist.metadata['Name']}=={dist.version}"
        (used if any(f in loaded_files for f in files) else unused).append(name)
    report["pack_distributions_loaded"] = sorted(used, key=str.lower)
    report["pack_distributions_never_imported"] = sorted(unused, key=str.lower)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a tiny HF checkpoint for prepare_server_args")
    ap.add_argument("--walk", action="store_true", help="import fixpoint over the sglang modules reached")
    ap.add_argument("--no-fake-gpu", action="store_true")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args()
    if not args.no_fake_gpu:
        fake_h200()
    report: dict = {"python": sys.version.split()[0]}
    for d in ["sglang", "sglang-kernel", "flashinfer-python", "transformers", "tokenizers", "torch", "pydantic"]:
        try:
            report.setdefault("versions", {})[d] = md.version(d)
        except md.PackageNotFoundError:
            report.setdefault("versions", {})[d] = None
    report["imports"] = {m: (try_import(m) or "OK") for m in SERVING_MODULES}
    import sgl_kernel  # noqa: F401 - after the fake GPU: sm90 ops registered against this torch?
    import torch

    report["sgl_kernel_ops_registered"] = hasattr(torch.ops.sgl_kernel, "rmsnorm") and hasattr(
        torch.ops.sgl_kernel, "fused_add_rmsnorm"
    )
    if args.model:
        try:
            from sglang.srt.server_args import prepare_server_args

            sa = prepare_server_args(["--model-path", args.model, *FIRST_TRY_FLAGS])
            report["prepare_server_args"] = {
                k: getattr(sa, k)
                for k in [
                    "attention_backend",
                    "sampling_backend",
                    "enable_memory_saver",
                    "mem_fraction_static",
                    "grammar_backend",
                    "dtype",
                ]
            }
        except BaseException:  # noqa: BLE001
            report["prepare_server_args"] = "FAIL: " + traceback.format_exc(limit=-3)
    if args.walk:
        walk(report)
    site = os.environ.get("SGL_SITE") or os.path.dirname(os.path.dirname(sgl_kernel.__file__))
    pack_distributions(site, report)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    bad = [m for m, r in report["imports"].items() if r != "OK"]
    return 1 if bad or str(report.get("prepare_server_args", "")).startswith("FAIL") else 0


if __name__ == "__main__":
    sys.exit(main())
