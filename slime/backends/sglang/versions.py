"""What each SGLang release's HTTP server speaks, as far as slime relies on it.

Users run the SGLang their image has, so the one client (`client.py`) asks a server its version
(`/server_info`'s `version`) and speaks that release's protocol. Read from each release's
`python/sglang/srt/entrypoints/http_server.py` and `python/sglang/srt/managers/io_struct.py`, 0.5.14 to 0.5.23:

| since  | what changed                                                                                   |
|--------|------------------------------------------------------------------------------------------------|
| 0.5.14 | oldest release slime was checked against (torch 2.11 wheels: 0.5.14-0.5.17)                     |
| 0.5.21 | `/begin_weight_update` ... `/end_weight_update`: weight updates load only inside such a session; |
|        | `/weights_checker` takes `skip_tensor_list` (older servers ignore unknown fields: no error)      |
|        | `/get_weight_version` is gone (`/model_info` carries `weight_version` in every release)          |

Unchanged across the range: `/update_weights_from_tensor` takes `serialized_named_tensors` (one payload per TP
rank), `load_format` (`flattened_bucket`), `flush_cache`, `weight_version`; `/pause_generation` takes `mode`
(`abort` | `retract` | `in_place`); `/release_memory_occupation` / `/resume_memory_occupation` take `tags`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

logger = logging.getLogger(__name__)

OLDEST = "0.5.14"
NEWEST = "0.5.23"
SESSIONS_SINCE = "0.5.21"
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True)
class SGLangProtocol:
    """The parts of one release's HTTP protocol that differ across the supported range."""

    version: str
    weight_update_sessions: bool  # /begin_weight_update ... /end_weight_update exist and are required
    checker_skip_list: bool  # /weights_checker honours skip_tensor_list
    checked: bool  # within the range whose sources slime was checked against

    def describe(self) -> str:
        session = "weight updates in sessions" if self.weight_update_sessions else "weight updates without sessions"
        return f"SGLang {self.version} ({session}{'' if self.checked else '; not a release slime was checked with'})"


def release(version: str) -> tuple[int, ...]:
    """(0, 5, 17) for '0.5.17', '0.5.17.post2', '0.5.18rc0' (a pre-release counts as its release)."""
    try:
        return Version(version).release
    except InvalidVersion as e:
        raise ValueError(f"not an SGLang version: {version!r}") from e


def protocol_for(version: str) -> SGLangProtocol:
    """The protocol a server reporting `version` speaks. Releases newer than the newest checked one are spoken
    to as that one (with a warning); older ones than the oldest are refused."""
    r = release(version)
    if r < release(OLDEST):
        raise ValueError(f"SGLang {version} is older than {OLDEST}, the oldest release slime speaks")
    checked = r <= release(NEWEST)
    if not checked:
        logger.warning("SGLang %s is newer than %s, the newest release slime was checked with", version, NEWEST)
    sessions = r >= release(SESSIONS_SINCE)
    return SGLangProtocol(
        version=version, weight_update_sessions=sessions, checker_skip_list=sessions, checked=checked
    )
