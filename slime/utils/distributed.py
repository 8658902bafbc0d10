"""Process-group rendezvous that listens only on the node's own address.

torch's defaults listen on every interface: `tcp://` rendezvous creates a TCPStore bound to 0.0.0.0, and gloo
binds whatever the host name resolves to. slime binds the address of the Ray node a rank runs on, so a
multi-node run uses the network Ray was told to use, and nothing listens where it was not asked to.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from slime.utils.http_utils import find_free_port

_GLOO = c10d.ProcessGroupGloo
_bound_host: str | None = None


def listen_socket(host: str) -> socket.socket:
    """A TCP socket listening on `host` at a free port (`sock.getsockname()[1]`); held, so nobody takes it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, find_free_port(host=host)))
    sock.listen(1024)
    return sock


def master_store(sock: socket.socket, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store served on an already listening socket (the store takes the socket over)."""
    host, port = sock.getsockname()[:2]
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=sock.detach(), use_libuv=False
    )


def client_store(host: str, port: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, use_libuv=False)


class _NodeGloo(_GLOO):
    """ProcessGroupGloo whose transport listens on the bound host instead of the host name's address."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any = datetime.timedelta(minutes=30)) -> None:
        if isinstance(timeout, _GLOO._Options):  # an explicit options object: leave it alone
            super().__init__(store, rank, size, timeout)
            return
        opts = _GLOO._Options()
        opts._timeout = timeout
        opts._devices = [_GLOO.create_device(hostname=_bound_host)]
        opts._threads = 2
        super().__init__(store, rank, size, opts)


def bind_gloo_to(host: str) -> None:
    """Every gloo group this process creates from now on (megatron's included) listens on `host`."""
    global _bound_host
    _bound_host = host
    c10d.ProcessGroupGloo = _NodeGloo
