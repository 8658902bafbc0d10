"""Distributed weight updates of the fake server, mirroring SGLang 0.5.23.

Endpoints (python/sglang/srt/entrypoints/http_server.py; bodies from python/sglang/srt/managers/io_struct.py):

- ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size,
  group_name="weight_update_group", backend="nccl"}`` → ``{"success", "message"}``, 200 or 400. Every TP rank of the engine joins the group as
  rank ``rank_offset + tp_rank`` (model_runner_components/weight_updater.py `init_weights_update_group`).
- ``POST /update_weights_from_distributed`` ``{names, dtypes, shapes, group_name, flush_cache=true,
  abort_all_requests=false, weight_version=null, load_format=null}``: each rank receives the tensors by
  ``broadcast`` from group rank 0 — one broadcast per tensor, or for ``load_format: "flattened_bucket"`` one
  broadcast of a uint8 buffer holding the tensors back to back (weight_sync/tensor_bucket.py
  `FlattenedTensorBucket.empty`) — then loads them. 0.5.23 accepts it only inside a weight-update session.
- ``POST /destroy_weights_update_group`` ``{group_name}``.
- ``POST /begin_weight_update`` ``{selector="all"}`` / ``POST /end_weight_update`` ``{}``: open / close the
  session (managers/scheduler_components/weight_updater.py); a second begin or an end without begin fails.

How a k-GPU engine is faked: ``--tp-size k`` makes this one process join the group as k members, one
thread per "GPU", each with its own gloo backend over the same rendezvous keys torch's process-group
constructor uses (so a trainer that creates the group the way SGLang's `init_custom_process_group` does
meets real peers); each member's gloo listens on the server's ``--host`` only. Every member receives every byte; the engine loads member 0's copy after checking that
all members received identical bytes (they are TP replicas here; SGLang would shard).

Bodies are validated as SGLang's FastAPI layer does (validation.py): a malformed one is a 400 ``ErrorResponse``
before any group is touched. Each request's log record carries what tests read: the group's ``member_ranks`` and ``tp_size`` on init;
``num_tensors``, ``bytes``, ``member_digests`` (SHA-256 of what each member received) on update.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web

from sim.fake_sglang import validation as v
from sim.fake_sglang.releases import has_update_sessions

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class WeightGroupMember:
    """One rank of the external group: the backend torch's group constructor would build for it."""

    def __init__(
        self,
        backend: str,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        name: str,
        bind_host: str | None = None,
    ) -> None:
        from torch.distributed.distributed_c10d import Backend, BackendConfig, PrefixStore

        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
        # init_custom_process_group prefixes the rendezvous store with the group name; the constructor adds
        # "{group_name}/" and then "{device}/" (one backend serves every device when it is the same backend).
        base = PrefixStore(f"{name}/", PrefixStore(name, store))
        devices = BackendConfig(Backend(backend)).get_device_backend_map()
        device = next(iter(devices))
        if len(set(devices.values())) != 1:
            raise ValueError(f"backend {backend!r}: one backend per device is not supported by the fake")
        if backend == "gloo":
            if bind_host and bind_host not in ("0.0.0.0", "::", ""):
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
                self.pg = dist.ProcessGroupGloo(PrefixStore(f"{device}/", base), rank, world_size, opts)
            else:
                self.pg = dist.ProcessGroupGloo(PrefixStore(f"{device}/", base), rank, world_size, timeout)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            if not torch.cuda.is_available():
                raise ValueError("backend nccl needs CUDA; this fake engine runs on the CPU (use gloo)")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(PrefixStore(f"{device}/", base), rank, world_size, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"unsupported backend {backend!r}")
        self.rank = rank

    def receive(self, buffer: torch.Tensor) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.pg.broadcast([buffer], opts).wait()
        return buffer


class WeightGroup:
    """The k members of this engine in one named group; blocking methods run in the group's own threads."""

    def __init__(self, body: dict[str, Any], tp_size: int, bind_host: str | None = None) -> None:
        self.name = body["group_name"]
        self.backend = body["backend"]
        self.rank_offset = body["rank_offset"]
        self.world_size = body["world_size"]
        self.tp_size = tp_size
        self.bind_host = bind_host
        self.ranks = [self.rank_offset + i for i in range(tp_size)]
        if self.rank_offset < 1 or self.ranks[-1] >= self.world_size:
            raise ValueError(f"ranks {self.ranks} do not fit world_size {self.world_size} (rank 0 is the sender)")
        # refused before the rendezvous, which would otherwise block for JOIN_TIMEOUT_S on a bad address
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"unsupported backend {self.backend!r}")
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend nccl needs CUDA; this fake engine runs on the CPU (use gloo)")
        if not 0 < body["master_port"] < 65536:
            raise ValueError(f"master_port {body['master_port']} is not a TCP port")
        self.master = (body["master_address"], body["master_port"])
        self.pool = ThreadPoolExecutor(max_workers=tp_size, thread_name_prefix=f"wg-{self.name}")
        self.members: list[WeightGroupMember] = []

    async def join(self) -> None:
        loop = asyncio.get_running_loop()
        futs = [
            loop.run_in_executor(
                self.pool, WeightGroupMember, self.backend, *self.master, r, self.world_size, self.name, self.bind_host
            )
            for r in self.ranks
        ]
        self.members = list(await asyncio.gather(*futs))

    async def receive(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], load_format: str | None
    ) -> tuple[list[tuple[str, torch.Tensor]], list[str], int]:
        """(named tensors of member 0, per-member digest of the received bytes, bytes received)."""
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError("names, dtypes and shapes must be non-empty and of equal length")
        specs = [(n, _dtype(d), torch.Size(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        loop = asyncio.get_running_loop()
        if load_format == "flattened_bucket":
            nbytes = 0
            for name, dtype, shape in specs:
                if nbytes % dtype.itemsize:
                    raise ValueError(f"Unaligned received tensor {name}: byte offset {nbytes}, dtype {dtype}")
                nbytes += shape.numel() * dtype.itemsize
            futs = [
                loop.run_in_executor(self.pool, m.receive, torch.empty(nbytes, dtype=torch.uint8, device=m.device))
                for m in self.members
            ]
            flats = list(await asyncio.gather(*futs))
            per_member = [[f] for f in flats]
            out, off = [], 0
            for name, dtype, shape in specs:
                size = shape.numel() * dtype.itemsize
                out.append((name, flats[0][off : off + size].view(dtype).reshape(shape)))
                off += size
        elif load_format in (None, "direct"):
            per_member = [[] for _ in self.members]
            for _, dtype, shape in specs:  # one broadcast per tensor, in order, as the sender issues them
                futs = [
                    loop.run_in_executor(self.pool, m.receive, torch.empty(shape, dtype=dtype, device=m.device))
                    for m in self.members
                ]
                for i, t in enumerate(await asyncio.gather(*futs)):
                    per_member[i].append(t)
            out = [(name, t) for (name, _, _), t in zip(specs, per_member[0], strict=True)]
            nbytes = sum(t.numel() * t.element_size() for t in per_member[0])
        else:
            raise ValueError(f"unsupported load_format {load_format!r}")
        digests = [_digest(ts) for ts in per_member]
        if len(set(digests)) != 1:
            raise RuntimeError(f"the engine's ranks received different bytes: {digests}")
        return out, digests, nbytes

    def close(self) -> None:
        self.members = []  # gloo contexts close when their backends are collected
        self.pool.shutdown(wait=False)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _reply(success: bool, message: str) -> web.Response:
    # http_server.py answers {"success", "message"} with 200, or 400 on failure
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


def register_weight_group_endpoints(
    app: web.Application, engine: Any, state: dict[str, Any], tp_size: int, bind_host: str | None = None
) -> None:
    """Add the distributed weight-update endpoints and the weight-update session to the fake server's app.
    `bind_host`: the server's --host, where the members' gloo sockets listen (None: gloo's default device)."""
    groups: dict[str, WeightGroup] = {}
    session: dict[str, Any] = state["weight_update_session"]  # shared with /update_weights_from_tensor
    sessions = has_update_sessions(state["version"])  # releases without them load outside any session

    async def body_of(request: web.Request, model: v.Model) -> dict[str, Any]:
        """The validated body (a v.RequestError with SGLang's 400 otherwise); the raw one goes to the log."""
        raw = await v.read_body(request)
        if isinstance(raw, dict):
            request["log"]["body"] = raw
        return model.validate(raw)

    async def init_group(request: web.Request) -> web.Response:
        body = await body_of(request, v.INIT_GROUP)
        name, group = body["group_name"], None
        try:
            if name in groups:
                raise ValueError(f"group {name!r} already exists; destroy it first")
            group = WeightGroup(body, tp_size, bind_host)
            request["log"].update(member_ranks=group.ranks, tp_size=tp_size)
            await group.join()
        except Exception as e:  # noqa: BLE001 - SGLang reports any failure as success=false
            logger.error("init_weights_update_group failed: %s", e)
            if group is not None:
                group.close()
            return _reply(False, f"Failed to initialize custom process group: {e}.")
        groups[name] = group
        return _reply(True, "Succeeded to initialize custom process group.")

    async def destroy_group(request: web.Request) -> web.Response:
        body = await body_of(request, v.DESTROY_GROUP)
        group = groups.pop(body["group_name"], None)
        if group is None:
            return _reply(False, "The group to be destroyed does not exist.")
        group.close()
        return _reply(True, "Succeeded to destroy custom process group.")

    async def update_from_distributed(request: web.Request) -> web.Response:
        body = await body_of(request, v.UPDATE_FROM_DISTRIBUTED)
        raw = request["log"]["body"]
        request["log"]["body"] = {k: x for k, x in raw.items() if k not in ("names", "dtypes", "shapes")}
        request["log"]["num_tensors"] = len(body["names"])
        name = body["group_name"]
        if sessions and not session["open"]:
            return _reply(False, "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")  # fmt: skip
        if name not in groups:
            return _reply(False, f"Group {name} not in {list(groups)}. Please call `init_weights_update_group` first.")
        if body["abort_all_requests"]:
            engine.abort(abort_all=True)
        try:
            named, digests, nbytes = await groups[name].receive(
                body["names"], body["dtypes"], body["shapes"], body["load_format"]
            )
            request["log"].update(bytes=nbytes, member_digests=digests, tensor_names=[n for n, _ in named])
            await engine.load_named_tensors([(n, t.clone()) for n, t in named])
        except Exception as e:  # noqa: BLE001 - answered like SGLang: success false, 400
            logger.error("update_weights_from_distributed failed: %s", e)
            return _reply(False, f"Failed to receive weights: {e}")
        session["loaded"] = True
        if body["flush_cache"] and not engine.flush_cache():  # the scheduler asserts here: fail as loudly
            logger.error("Cache flush failed after updating weights: %d requests unfinished", engine.num_unfinished)
            return v.error_message("Cache flush failed after updating weights", status=500)
        message = "Succeeded to update parameter online."
        if body["weight_version"] is not None:
            engine.weight_version = body["weight_version"]
            message += f" Weight version updated to {engine.weight_version}."
        return _reply(True, message)

    async def begin_update(request: web.Request) -> web.Response:
        await body_of(request, v.BEGIN_UPDATE)
        if session["open"]:
            return _reply(False, "a weight-update session is already open; call end_weight_update() first")
        session.update(open=True, loaded=False)
        return _reply(True, "Success")

    async def end_update(request: web.Request) -> web.Response:
        await body_of(request, v.END_UPDATE)
        if not session["open"]:
            return _reply(False, "no weight-update session is open; call begin_weight_update() first")
        session.update(open=False)
        return _reply(True, "Success")

    async def on_cleanup(_app: web.Application) -> None:
        for g in groups.values():
            g.close()
        groups.clear()

    r = app.router
    r.add_post("/init_weights_update_group", init_group)
    r.add_post("/destroy_weights_update_group", destroy_group)
    r.add_post("/update_weights_from_distributed", update_from_distributed)
    if sessions:
        r.add_post("/begin_weight_update", begin_update)
        r.add_post("/end_weight_update", end_update)
    app.on_cleanup.append(on_cleanup)
    state["weight_groups"] = groups
