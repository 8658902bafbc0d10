"""`SGLangEngine`: a thin Ray actor that owns one inference server process (real SGLang or `sim.fake_sglang`).

The actor sits on the engine's first placement-group bundle (0.2 GPU) so the scheduler accounts for it like
any other GPU consumer; the server itself is a child process whose argv comes from `build_server_argv`. The
child gets PR_SET_PDEATHSIG so it cannot outlive a killed actor.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from argparse import Namespace
from typing import Any

import httpx

from slime.backends.sglang.server_args import build_server_argv

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def resolve_backend(args: Namespace) -> str:
    """`--rollout-engine auto` picks real SGLang only where it can run (installed and CUDA present)."""
    if args.rollout_engine != "auto":
        return args.rollout_engine
    import importlib.util

    import torch

    return "sglang" if importlib.util.find_spec("sglang") is not None and torch.cuda.is_available() else "sim"


class SGLangEngine:
    def __init__(
        self,
        args: Namespace,
        rank: int,
        *,
        base_gpu_id: int = 0,
        num_gpus: int = 1,
        worker_type: str = "regular",
        overrides: dict[str, Any] | None = None,
        model_path: str | None = None,
        log_dir: str | None = None,
    ) -> None:
        self.args = args
        self.rank = rank
        self.base_gpu_id = base_gpu_id
        self.num_gpus = num_gpus
        self.worker_type = worker_type
        self.overrides = overrides
        self.model_path = model_path
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.host = "127.0.0.1"
        self.port: int | None = None

    def start(self, timeout: float = 600.0) -> str:
        """Launch the server and wait until `/health_generate` answers; returns its URL."""
        from slime.utils.http_utils import find_free_port

        self.port = find_free_port()
        backend = resolve_backend(self.args)
        argv = build_server_argv(
            self.args,
            backend=backend,
            host=self.host,
            port=self.port,
            base_gpu_id=self.base_gpu_id,
            num_gpus=self.num_gpus,
            rank=self.rank,
            nccl_port=find_free_port(),
            worker_type=self.worker_type,
            overrides=self.overrides,
            model_path=self.model_path,
        )
        log_path = None
        out = subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            log_path = os.path.join(self.log_dir, f"engine_{self.rank}.log")
            out = open(log_path, "ab")  # noqa: SIM115 - handed to the child for its lifetime
        logger.info("engine %d: %s", self.rank, " ".join(argv))
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = _tail(log_path)
                raise RuntimeError(f"engine {self.rank} exited with code {self.proc.returncode} during start-up{tail}")
            try:
                if httpx.get(f"{self.url}/health_generate", timeout=30).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.shutdown()
        raise TimeoutError(f"engine {self.rank} did not become healthy within {timeout:.0f}s{_tail(log_path)}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _post(self, endpoint: str, payload: dict[str, Any] | None = None, timeout: float = 600) -> Any:
        r = httpx.post(f"{self.url}{endpoint}", json=payload or {}, timeout=timeout)
        r.raise_for_status()
        return r.json() if r.content else None

    def health_generate(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health_generate", timeout=self.args.rollout_health_check_timeout).is_success
        except httpx.HTTPError:
            return False

    def flush_cache(self, timeout: float = 60.0) -> None:
        """SGLang refuses to flush (HTTP 400) while requests are running or waiting: retry until it is idle."""
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.post(f"{self.url}/flush_cache", timeout=timeout)
            if r.status_code == 200:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"engine {self.rank}: /flush_cache still refused after {timeout:.0f}s: {r.text[:200]}"
                )
            time.sleep(0.5)

    def pause_generation(self) -> Any:
        return self._post("/pause_generation")

    def continue_generation(self) -> Any:
        return self._post("/continue_generation")

    def get_weight_version(self) -> Any:
        return httpx.get(f"{self.url}/get_weight_version", timeout=30).json()

    def update_weights_from_tensor(self, payload: dict[str, Any]) -> Any:
        return self._post("/update_weights_from_tensor", payload)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> Any:
        return self._post("/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version})

    # ---- distributed weight update (io_struct.py of SGLang 0.5.23; see weight_sync_distributed.py) ---------
    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str = "nccl",
    ) -> Any:  # fmt: skip
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}  # fmt: skip
        return self._post("/init_weights_update_group", body)

    def destroy_weights_update_group(self, group_name: str) -> Any:
        return self._post("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        weight_version: str | None = None, load_format: str | None = None, flush_cache: bool = False,
    ) -> Any:  # fmt: skip
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "weight_version": weight_version, "load_format": load_format, "flush_cache": flush_cache}  # fmt: skip
        return self._post("/update_weights_from_distributed", body)

    def begin_weight_update(self) -> Any:
        return self._post("/begin_weight_update", {"selector": "all"})

    def end_weight_update(self) -> Any:
        return self._post("/end_weight_update")

    def check_weights(self, action: str = "checksum") -> Any:
        return self._post("/weights_checker", {"action": action})

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        self.flush_cache()
        return self._post("/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._post("/resume_memory_occupation", {"tags": tags})

    def shutdown(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=5)


def _tail(path: str | None, n: int = 20) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        lines = f.readlines()[-n:]
    return "; last log lines:\n" + "".join(lines)
