"""Simulated Megatron: N ranks in one process with megatron-core's rank layout, for property tests.

`SimulatedWorld(world_size, tp, pp, cp, ep, etp).run(fn)` calls `fn(ps)` on every rank, `ps` being a
`slime.parallel_state.ParallelState`. The layout math lives in `rank_layout` (no megatron import).
"""

from sim.fake_megatron.rank_layout import expert_rank_groups, rank_groups
from sim.fake_megatron.sim_world import (
    SIM_DIMS,
    CollectiveError,
    CollectiveTimeout,
    SimRank,
    SimulatedWorld,
    SimulationAborted,
)

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
