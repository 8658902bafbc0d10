"""Prepare workers: processes that turn large request bodies into `ApiRequest`s away from the gateway's loop.

Why processes: parsing, translating and rendering a big body is Python and C code that holds the GIL, so a
thread would still stall the loop (measured: 5 ms per wake-up of the loop while a thread renders, and 117 ms
at worst); a worker process does not share it. Two lanes: bodies up to `HUGE_BODY_BYTES` (Codex's
first request is ~90 KB, a long Claude Code context ~1 MB) go to normal-priority workers; larger ones, which no
agent client sends, to idle-class workers (SCHED_IDLE, else nice 19), which get only CPU nothing else on the
host wants (`bench/gateway_hostile.py` on 2 cores: the well-behaved p99 beside a hostile client rose 2.0-3.4x
with workers at nice 10, 1.6-2.0x idle-class). The price: on a saturated host a huge body waits until it is not.
Workers start on the first large body (a gateway that never sees
one pays nothing), each with the gateway's own tokenizer (pickled), so a request renders the same wherever it is
prepared; one that dies is replaced and its request answered 503 (retryable).

Wire: length-prefixed frames on the worker's stdin/stdout. First frame: pickle((tokenizer, context length,
bytes per token, idle)); then per job a header frame pickle((route, n_bytes)) followed by the body's n_bytes, raw
(streamed from the chunks the gateway read, never joined into one copy on the loop); the answer is one frame,
pickle(("ok", ApiRequest)) or pickle(("error", status, message)).

    python -m slime.agent.prepare_pool     # what the pool starts; not meant to be run by hand
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import struct
import sys
from typing import Any, BinaryIO

from slime.agent.api import ApiRequest, Unavailable
from slime.agent.context_limit import ContextLimit
from slime.agent.messages import BadRequest
from slime.utils.process import die_with_parent

logger = logging.getLogger(__name__)

_LEN = struct.Struct(">Q")
HUGE_BODY_BYTES = 4 << 20
WRITE_CHUNK = 1 << 20


# ---- the worker process --------------------------------------------------------------------------------------


def _read_exact(f: BinaryIO, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _read_frame(f: BinaryIO) -> bytes:
    return _read_exact(f, _LEN.unpack(_read_exact(f, _LEN.size))[0])


def _write_frame(f: BinaryIO, payload: bytes) -> None:
    f.write(_LEN.pack(len(payload)) + payload)
    f.flush()


def lowest_priority() -> None:
    """This process gets only otherwise idle CPU (SCHED_IDLE), or failing that the least of it (nice 19)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def worker_main() -> None:
    from slime.agent.prompts import PromptBuilder
    from slime.agent.requests import prepare

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames may reach the gateway on stdout
    tokenizer, context_length, bytes_per_token, idle = pickle.loads(_read_frame(stdin))
    builder, limit = PromptBuilder(tokenizer), ContextLimit(context_length, bytes_per_token)
    if idle:  # after start-up: only the jobs wait for idle CPU
        lowest_priority()
    while True:
        try:
            route, n = pickle.loads(_read_frame(stdin))
            raw = _read_exact(stdin, n)
        except EOFError:  # the gateway closed the pipe: done
            return
        try:
            answer: tuple[Any, ...] = ("ok", prepare(route, raw, builder, limit))
        except BadRequest as e:
            answer = ("error", e.status, str(e))
        except Exception:
            logger.exception("prepare worker: unexpected error on %s", route)
            answer = ("error", 500, "internal error of the gateway (details are in its log)")
        del raw
        _write_frame(stdout, pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))


# ---- the gateway's side ---------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def run(self, route: str, chunks: list[bytes], n: int) -> tuple[Any, ...]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        header = pickle.dumps((route, n))
        self.proc.stdin.write(_LEN.pack(len(header)) + header)
        for chunk in chunks:
            view = memoryview(chunk)
            for i in range(0, len(view), WRITE_CHUNK):  # bounded copies into the transport's buffer
                self.proc.stdin.write(view[i : i + WRITE_CHUNK])
                await self.proc.stdin.drain()
        await self.proc.stdin.drain()
        size = _LEN.unpack(await self.proc.stdout.readexactly(_LEN.size))[0]
        return pickle.loads(await self.proc.stdout.readexactly(size))

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


class PreparePool:
    """Up to `workers` prepare processes (idle-class ones with `idle`), started on demand; `prepare` waits for a
    free one."""

    def __init__(self, tokenizer: Any, limit: ContextLimit, workers: int, *, idle: bool = False) -> None:
        self._init = pickle.dumps((tokenizer, limit.context_length, limit.bytes_per_token, idle))
        self.max_workers = workers
        self._idle: list[_Worker] = []
        self._started = 0
        self._free = asyncio.Condition()
        self._all: set[_Worker] = set()

    async def _spawn(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "slime.agent.prepare_pool",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            preexec_fn=die_with_parent,
        )
        assert proc.stdin is not None
        proc.stdin.write(_LEN.pack(len(self._init)) + self._init)
        await proc.stdin.drain()
        w = _Worker(proc)
        self._all.add(w)
        return w

    async def _take(self) -> _Worker:
        async with self._free:
            while not self._idle and self._started >= self.max_workers:
                await self._free.wait()
            if self._idle:
                return self._idle.pop()
            self._started += 1
        try:
            return await self._spawn()
        except BaseException:
            await self._lost(None)
            raise

    async def _give_back(self, w: _Worker) -> None:
        async with self._free:
            self._idle.append(w)
            self._free.notify()

    async def _lost(self, w: _Worker | None) -> None:
        if w is not None:
            self._all.discard(w)
            await w.stop()
        async with self._free:
            self._started -= 1
            self._free.notify()

    async def prepare(self, route: str, chunks: list[bytes], n_bytes: int) -> ApiRequest:
        """The body (as read, in chunks) prepared in a worker; BadRequest as the worker raised it."""
        w = await self._take()
        job = asyncio.ensure_future(w.run(route, chunks, n_bytes))
        try:
            answer = await asyncio.shield(job)
        except asyncio.CancelledError:  # the client left: the worker finishes this job before it takes another
            job.add_done_callback(lambda j: asyncio.ensure_future(self._settle(w, j)))
            raise
        except (OSError, EOFError, asyncio.IncompleteReadError, pickle.UnpicklingError) as e:
            logger.warning("prepare worker %s died (%r): replacing it", w.proc.pid, e)
            await self._lost(w)
            raise Unavailable("the request could not be prepared (a gateway worker died); retry") from e
        await self._give_back(w)
        if answer[0] == "ok":
            return answer[1]
        raise BadRequest(answer[2], answer[1])

    async def _settle(self, w: _Worker, job: asyncio.Future) -> None:
        if job.cancelled() or job.exception() is not None:
            await self._lost(w)
        else:
            await self._give_back(w)

    async def close(self) -> None:
        for w in list(self._all):
            if w.proc.stdin is not None:
                w.proc.stdin.close()
        for w in list(self._all):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.proc.wait(), 5.0)
            await w.stop()
        self._all.clear()


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("SLIME_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    worker_main()
