"""Simulated Megatron: N ranks in one process with megatron-core's rank layout, for property tests.

`SimulatedWorld(world_size, tp, pp, cp, ep, etp).run(fn)` calls `fn(ps)` on every rank, `ps` being a
`slime.parallel_state.ParallelState`. The layout math lives in `slime.backends.megatron.rank_layout` (no megatron import; `slime plan` prints it too).
"""

from sim.fake_megatron.sim_world import (
    SIM_DIMS,
    CollectiveError,
    CollectiveTimeout,
    SimRank,
    SimulatedWorld,
    SimulationAborted,
)
from slime.backends.megatron.rank_layout import expert_rank_groups, rank_groups

__all__ = [
    "SIM_DIMS",
    "CollectiveError",
    "CollectiveTimeout",
    "SimRank",
    "SimulatedWorld",
    "SimulationAborted",
    "expert_rank_groups",
    "rank_groups",
]
