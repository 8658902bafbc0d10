"""The train side of the offload protocol on CPU: real release and restore of params and grads, the recorded call
order, and the byte ledger of both policies (slime/backends/megatron/offload.py).

The engine side and the interleaving of both (release after rollout, weights before the sync, KV after) are
checked on a full colocated run in tests/integration/test_resume.py; a real megatron trainer's ledger in
tests/unit/test_ppo_trainer.py.
"""

from __future__ import annotations

import pytest
import torch

from slime.backends.megatron.offload import TrainOffloader

pytestmark = pytest.mark.cpu


class _Model(torch.nn.Module):
    """Two params and a megatron-style grad buffer (`main_grad` views of one storage, as DDP makes them)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(3, 2))
        self.b = torch.nn.Parameter(torch.randn(4))
        buf = torch.zeros(10)
        self.a.main_grad = buf[:6].view(3, 2)
        self.b.main_grad = buf[6:]


def _setup(legacy: bool):
    model = _Model()
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
    off = TrainOffloader(enabled=True, legacy=legacy)
    off.attach(model, opt)
    return model, off, opt


def test_disabled_offloader_does_nothing():
    model, _, _ = _setup(False)
    off = TrainOffloader(enabled=False)
    off.attach(model, torch.optim.Adam(model.parameters()))
    with off.region("model"):
        pass
    off.sleep()
    off.note("update_weights")
    assert not off.asleep and off.events == [] and off.calls == []
    assert model.a.untyped_storage().nbytes() == 24


def test_default_policy_releases_params_and_grads_and_restores_from_the_host_copy():
    model, off, opt = _setup(legacy=False)
    assert off.backend == "cpu"  # no CUDA here: torch_memory_saver is never used
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt_state = opt.state
    opt_before = {id(st): {k: v.clone() for k, v in st.items()} for st in opt_state.values()}
    model.a.main_grad.fill_(3.0)
    off.sleep()
    off.sleep()  # a second sleep is a no-op (the driver may ask twice)
    assert off.asleep and off.calls == ["release:grads", "pause:optimizer", "copy_params_to_pinned", "release:params"]
    assert model.a.untyped_storage().nbytes() == 0 and model.a.main_grad.untyped_storage().nbytes() == 0
    exported = dict(off.named_params_for_export(model))  # what weight sync reads while asleep
    assert torch.equal(exported["a"], before["a"]) and exported["a"].untyped_storage().nbytes() == 24
    # asleep, the host holds the weights once (4 B/param in fp32) and the optimizer state (the backup)
    assert off.ledger.host == {"params": 0, "grads": 0, "optimizer": 80, "weights_copy": 40}
    assert off.ledger.device == {"params": 0, "grads": 0, "optimizer": 0, "weights_copy": 0}
    # the optimizer state really left its storages (copied to the host buffers first)
    assert all(v.untyped_storage().nbytes() == 0 for st in opt_state.values() for k, v in st.items() if k != "step")
    off.note("update_weights")
    off.wake_up()
    off.wake_up()
    assert off.calls[4:] == ["resume:optimizer", "restore_params", "zero_grads"]
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(torch.equal(v, opt_before[id(st)][k]) for st in opt_state.values() for k, v in st.items())
    assert torch.equal(model.a.main_grad, torch.zeros(3, 2))  # grads come back zeroed: no copy was kept
    assert off.ledger.host["weights_copy"] == 40  # the pinned copy is made once and kept for the next sleeps
    assert [name for _, name in off.events] == ["sleep", "update_weights", "wake_up"]
    assert exported["a"] is off.host_weights["a"]
    off.sleep()
    assert off.ledger.host["weights_copy"] == 40  # refreshed in place, not a second copy


def test_sleep_keeping_the_weights_for_the_sync_then_releasing_them():
    """`sleep(keep_weights=True)`: optimizer and grads go, params stay live (what the sync reads); the next
    `sleep()` releases them; a wake-up from either half restores exactly what left."""
    model, off, opt = _setup(legacy=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    off.sleep()
    off.wake_up()
    with torch.no_grad():
        model.a.add_(1.0)  # a train step changes the weights after the last full sleep
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    n_calls = len(off.calls)
    off.sleep(keep_weights=True)
    assert off.drowsy and not off.asleep
    assert off.calls[n_calls:] == ["release:grads", "pause:optimizer"]
    assert model.a.untyped_storage().nbytes() == 24 and model.a.main_grad.untyped_storage().nbytes() == 0
    exported = dict(off.named_params_for_export(model))
    assert exported["a"] is model.a  # the live parameter, not the (stale) host copy
    assert not torch.equal(off.host_weights["a"], trained["a"])
    assert off.ledger.device["params"] == 40 and off.ledger.device["optimizer"] == 0
    off.sleep()
    assert off.asleep and not off.drowsy
    assert off.calls[n_calls + 2 :] == ["copy_params_to_pinned", "release:params"]
    assert torch.equal(off.host_weights["a"], trained["a"]) and model.a.untyped_storage().nbytes() == 0
    assert [name for _, name in off.events][-2:] == ["sleep", "release_weights"]
    off.wake_up()
    assert all(torch.equal(trained[n], p) for n, p in model.named_parameters())
    # a wake-up from the first half: optimizer and grads come back, the params were never touched
    off.sleep(keep_weights=True)
    n_calls = len(off.calls)
    off.wake_up()
    assert off.calls[n_calls:] == ["resume:optimizer", "zero_grads"] and not off.drowsy and not off.asleep
    assert all(torch.equal(trained[n], p) for n, p in model.named_parameters())
    assert off.ledger.device == {"params": 40, "grads": 40, "optimizer": 80, "weights_copy": 0}
    assert not torch.equal(before["a"], model.a)


def test_legacy_policy_books_everything_plus_one_more_copy():
    model, off, _ = _setup(legacy=True)
    with torch.no_grad():
        model.b.add_(1.0)
    off.sleep()
    assert off.calls == ["copy_params_unpinned", "pause:train"]
    assert off.ledger.host == {"params": 40, "grads": 40, "optimizer": 80, "weights_copy": 40}
    assert torch.equal(dict(off.named_params_for_export(model))["b"], model.b.detach())
    off.wake_up()
    assert off.calls[2:] == ["resume:train", "restore_params"] and off.host_weights is None
    assert off.ledger.host == dict.fromkeys(("params", "grads", "optimizer", "weights_copy"), 0)


def test_saving_is_param_bytes_plus_fp32_grad_per_param():
    host = {}
    for legacy in (False, True):
        _, off, _ = _setup(legacy)
        off.sleep()
        host[legacy] = off.ledger.totals()["host"]
    numel = 10
    assert host[True] - host[False] == (4 + 4) * numel  # fp32 here: p = 4; with bf16 it is 2 + 4 = 6 B/param


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
    # PPO time-shares each GPU between actor and critic: offload is on unless asked off
    assert _args("--rollout-num-gpus", "2", "--advantage-estimator", "ppo").offload_train
