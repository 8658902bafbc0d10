"""SGLang's content hash of a GPU tensor, recomputed with plain torch integer ops on any device.

Why: a GPU SGLang's `/weights_checker` hashes each weight with a Triton kernel (`gpu_tensor_hash`,
python/sglang/kernels/ops/memory/gpu_tensor_hash.py; 0.5.17 and 0.5.23 alike), not with the SHA-256 its CPU path
uses. To compare the engine's checksums with the tensors the trainer sent, the trainer must hash them the same way.

The algorithm, as the kernel computes it: the tensor's bytes as little-endian 32-bit words (zero-padded to a
multiple of 4 bytes); for word i with value v, ``k1 = fmix32(v ^ ((i*POS_C1 + s1) ^ rotl(i, 15)))`` and ``k2``
likewise with POS_C2, s2 and rotl(i, 13); per tile of 8192 words ``h = fmix32(sum(k) mod 2**32 ^ nbytes)`` for
both halves, the tile's value ``h1 << 32 | h2``; the tiles' values summed mod 2**64; that sum through
splitmix64's finaliser. Arithmetic mod 2**32 is done in int64 (products are split in 16-bit halves so that no int64 product overflows), a tensor hashed in chunks of
tiles to bound the temporaries.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_FMIX_C1, _FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
_POS_C1, _POS_C2 = 0x27D4EB2D, 0x165667B1
_SEED = 0x243F6A88
_TILE = 8192  # words per tile (the kernel's tile_words default)
_CHUNK_TILES = 2048  # tiles hashed at a time: 16 Mi words, a few 128 MiB int64 temporaries


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32) and a constant c < 2**32, every intermediate below 2**49."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX_C2)
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as uint32 words held in int64 (row-major order for a non-contiguous tensor)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int32).to(torch.int64) & _M32


def _splitmix64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@torch.no_grad()
def gpu_tensor_hash(t: torch.Tensor) -> int:
    """The 64-bit value SGLang's `gpu_tensor_hash(t)` returns for `t` (computed on `t`'s own device)."""
    words = _words(t)
    n = words.numel()
    if n == 0:
        return 0
    s1 = _SEED & _M32
    s2 = ((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    nbytes = (n * 4) & _M32
    total = 0
    step = _TILE * _CHUNK_TILES
    for start in range(0, n, step):
        v = words[start : start + step]
        i = torch.arange(start, start + v.numel(), device=v.device, dtype=torch.int64) & _M32
        halves = []
        for pos, seed, rot in ((_POS_C1, s1, 15), (_POS_C2, s2, 13)):
            k = _fmix32(v ^ ((_mul32(i, pos) + seed) & _M32 ^ _rotl32(i, rot)))
            k = torch.nn.functional.pad(k, (0, (-k.numel()) % _TILE))  # a tile's masked tail adds nothing
            h = (k.view(-1, _TILE).sum(dim=1) & _M32) ^ nbytes
            halves.append(_fmix32(h))
        # sum of the tiles' (h1 << 32 | h2) = sum(h1) << 32 + sum(h2): sums of < 2**32 values, no overflow
        total += (int(halves[0].sum().item()) << 32) + int(halves[1].sum().item())
    return _splitmix64(total & _M64)


def gpu_tensor_checksum(t: torch.Tensor) -> str:
    """`/weights_checker`'s per-tensor string for a tensor a GPU SGLang holds: ``f"{gpu_tensor_hash(t):016x}"``."""
    return f"{gpu_tensor_hash(t):016x}"
