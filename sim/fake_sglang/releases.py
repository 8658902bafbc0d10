"""The SGLang releases the fake can speak, and what differs between them (`--sglang-version`).

Read from each release's python/sglang/srt/entrypoints/http_server.py and managers/io_struct.py; the fake keeps its
own table (not slime's) so a test of slime's version handling against the fake checks two readings of SGLang, not
one reading twice:

- 0.5.21 added the weight-update session (`/begin_weight_update`, `/end_weight_update`; scheduler_components/
  weight_updater.py refuses `update_weights_from_tensor` / `_from_distributed` outside one) and `/weights_checker`'s
  `skip_tensor_list`; it removed `/get_weight_version`, which 0.5.14-0.5.20 answer with a 404 and a pointer to
  `/model_info`.
- Before 0.5.21 the checker's `parallelism_info` has no `role` (utils/weight_checker.py: ParallelismInfo).
"""

from __future__ import annotations

SGLANG_VERSIONS = tuple(f"0.5.{n}" for n in range(14, 24))  # oldest first; the default is the newest


def release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:3])


def has_update_sessions(version: str) -> bool:
    return release(version) >= (0, 5, 21)
