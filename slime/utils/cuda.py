"""Whether this process can use a CUDA GPU, asked without importing torch.

The driver and the engine actors only need the answer to pick flags (logical GPUs for Ray, `--device` for a
fake engine); importing torch for it costs each of them ~3 CPU-seconds, which adds up over a run's many
processes on a laptop. The question asked is the one `torch.cuda.is_available()` asks: does the CUDA driver
load and report at least one device visible to this process (CUDA_VISIBLE_DEVICES applies).
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def cuda_available() -> bool:
    torch = sys.modules.get("torch")
    if torch is not None:  # already paid for: ask it, it knows about every way CUDA can be hidden
        return bool(torch.cuda.is_available())
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver on this machine
        return False
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    return count.value > 0
