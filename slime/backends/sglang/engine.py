"""`SGLangEngine`: a thin Ray actor that owns one inference server process (real SGLang or a server plugin's).

The actor sits on a placement-group bundle (0.2 GPU) so the scheduler accounts for it like any other GPU
consumer; the server is a child process (`slime/utils/process.py`: its own process group, dies with the actor).
It binds the address of the Ray node it runs on, so engines on other nodes are reachable. An engine larger
than a node is one actor per node: node rank 0 serves HTTP and is "the engine"; the others join it through
`--dist-init-addr` (SGLang's multi-node launch) and serve nothing. Control calls go through `SGLangClient`.
"""

from __future__ import annotations

import logging
import os
from argparse import Namespace
from typing import Any

from slime.backends.sglang.client import SGLangClient
from slime.backends.sglang.engine_choice import choose_rollout_engine
from slime.backends.sglang.server_args import build_server_argv
from slime.utils.console import configure_actor
from slime.utils.http_utils import find_free_port, node_address
from slime.utils.process import ManagedProcess, log_tail, start_with_free_port

logger = logging.getLogger(__name__)


def resolve_backend(args: Namespace) -> str:
    """'sglang' or a server plugin's name: decided by the driver's preflight (`engine_choice.check_rollout_engine` writes it back
    onto args); asked again here only for an `auto` that reached an engine without one."""
    if args.rollout_engine != "auto":
        return args.rollout_engine
    engine, why = choose_rollout_engine(args)
    logger.info("rollout engine: %s", why)
    return engine


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
        nnodes: int = 1,
        node_rank: int = 0,
    ) -> None:
        node = f"_node{node_rank}" if nnodes > 1 else ""
        configure_actor(args.log_level, args.metrics_dir, f"engine_actor_{rank}{node}")
        self.args = args
        self.rank = rank
        self.base_gpu_id = base_gpu_id
        self.num_gpus = num_gpus
        self.worker_type = worker_type
        self.overrides = overrides
        self.model_path = model_path
        self.log_dir = log_dir
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.host = node_address()
        self.port: int | None = None
        self.bootstrap_port: int | None = None
        self.process: ManagedProcess | None = None
        self.client: SGLangClient | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        return f"engine {self.rank}" + (f" node {self.node_rank}/{self.nnodes}" if self.nnodes > 1 else "")

    def dist_init_address(self) -> str:
        """Node rank 0 of a multi-node engine: where the other nodes join it (an address on this node)."""
        return f"{self.host}:{find_free_port(host=self.host)}"

    def start(self, dist_init_addr: str | None = None, timeout: float = 600.0) -> str | None:
        """Launch the server; node rank 0 returns its URL once `/health_generate` answers (which, for a multi-node
        engine, needs every node joined), the other node ranks return None once their process runs. Ports are
        picked per attempt: a child that lost its port to another process is started again on new ones."""
        return start_with_free_port(lambda: self._start_once(dist_init_addr, timeout), self.name)

    def _start_once(self, dist_init_addr: str | None, timeout: float) -> str | None:
        self.port = find_free_port(host=self.host)
        if self.worker_type == "prefill" and self.node_rank == 0:
            self.bootstrap_port = find_free_port(host=self.host)
        argv = build_server_argv(
            self.args, backend=resolve_backend(self.args), host=self.host, port=self.port,
            base_gpu_id=self.base_gpu_id, num_gpus=self.num_gpus, rank=self.rank,
            nccl_port=find_free_port(host=self.host), worker_type=self.worker_type,
            bootstrap_port=self.bootstrap_port, overrides=self.overrides, model_path=self.model_path,
            nnodes=self.nnodes, node_rank=self.node_rank, dist_init_addr=dist_init_addr,
        )  # fmt: skip
        suffix = f"_node{self.node_rank}" if self.nnodes > 1 else ""
        log_path = os.path.join(self.log_dir, f"engine_{self.rank}{suffix}.log") if self.log_dir else None
        self.process = ManagedProcess.start(argv, name=self.name, log_path=log_path)
        if self.node_rank > 0:
            return None
        self.client = SGLangClient(self.url)
        self.process.wait_healthy(self.client.healthy, timeout, interval=0.3, port=self.port)
        logger.info("%s at %s: %s", self.name, self.url, self.client.protocol.describe())  # asked once, kept
        return self.url

    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.alive

    def log_tail(self) -> str:
        return log_tail(self.process.log_path if self.process else None)

    def get_bootstrap_port(self) -> int | None:
        return self.bootstrap_port

    def health_generate(self) -> bool:
        return self.client is not None and self.client.healthy(timeout=self.args.rollout_health_check_timeout)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.client.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.client.resume_memory_occupation(tags)

    def shutdown(self) -> None:
        if self.process is not None:
            self.process.stop()
        if self.client is not None:
            self.client.close()

    def kill_server(self) -> None:
        """SIGKILL the server's process group: in-flight requests fail at once (and are retried elsewhere)
        instead of coming back as aborted partial answers, which a graceful stop would produce."""
        if self.process is not None:
            self.process.kill()
