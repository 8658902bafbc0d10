"""The train side of the colocated offload protocol on CPU: no memory moves, but a real, recorded call sequence.

The engine side and the interleaving of both (release after rollout, weights before the sync, KV after) are
checked on a full colocated run in tests/integration/test_resume.py.
"""

from __future__ import annotations

import pytest
import torch

from slime.backends.megatron.offload import TrainOffloader

pytestmark = pytest.mark.cpu


def test_disabled_offloader_does_nothing():
    model = torch.nn.Linear(2, 2)
    off = TrainOffloader(enabled=False)
    with off.memory_region():
        pass
    off.sleep(model)
    off.note("update_weights")
    assert not off.asleep and off.events == []


def test_cpu_offloader_records_the_sequence_and_is_idempotent():
    model = torch.nn.Linear(3, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    off = TrainOffloader(enabled=True)
    assert off.backend == "noop"  # no CUDA here: torch_memory_saver is never used
    with off.memory_region():
        model2 = torch.nn.Linear(1, 1)  # allocations inside the region are ordinary on CPU
    assert model2.weight.numel() == 1
    off.sleep(model)
    off.sleep(model)  # a second sleep is a no-op (the driver may ask twice)
    assert off.asleep
    exported = off.named_params_for_export(model)  # asleep on CPU: the live parameters (nothing was freed)
    assert [n for n, _ in exported] == ["weight", "bias"] and exported[0][1] is model.weight
    off.note("update_weights")
    off.wake_up(model)
    off.wake_up(model)
    assert [name for _, name in off.events] == ["sleep", "update_weights", "wake_up"]
    times = [t for t, _ in off.events]
    assert times == sorted(times)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_host_copy_is_what_weight_sync_reads_while_asleep():
    """With a memory saver the parameters are gone while asleep; export must read the host copy instead."""
    model = torch.nn.Linear(2, 2)
    off = TrainOffloader(enabled=True)
    off.asleep = True
    off.param_backup = {n: torch.full_like(p, 7.0) for n, p in model.named_parameters()}
    exported = dict(off.named_params_for_export(model))
    assert torch.equal(exported["weight"], torch.full((2, 2), 7.0))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("offload") / "model"))


def test_weight_sync_mode_follows_placement(hf_dir):
    from slime.arguments import parse_args
    from slime.utils.errors import SlimeArgError

    def _args(*extra: str):
        return parse_args(["--hf-checkpoint", hf_dir, "--rollout-batch-size", "2", "--num-rollout", "1", *extra])

    colocated = _args("--colocate")
    assert colocated.offload_train and colocated.offload_rollout and colocated.update_weight_mode == "tensor"
    apart = _args("--rollout-num-gpus", "2")
    assert not apart.offload_train and apart.update_weight_mode == "distributed"
    assert _args("--rollout-num-gpus", "2", "--update-weight-mode", "tensor").update_weight_mode == "tensor"
    with pytest.raises(SlimeArgError, match="engines on their own GPUs"):
        _args("--colocate", "--update-weight-mode", "distributed")
    assert not _args("--colocate", "--no-offload-train").offload_train
