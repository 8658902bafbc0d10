"""Same numbers with expert parallelism, through real megatron-core on gloo: `MegatronTrainer.train` on a MoE model
(Qwen2-MoE layout: 4 routed experts, top-2 renormalised, a gated shared expert) gives the loss, every reduced
metric and every parameter's gradient (DDP-reduced, gathered over EP into HF names, every expert under its own
name, each pipeline stage's own layers) of the single-process run, for EP=2 (2 local experts per rank, attention
data-parallel), DP=2, CP=2, PP=2, EP=2 x CP=2, EP=2 x PP=2 and EP=2 x TP=2 with sequence parallelism and whole
experts (ETP=1; megatron-core trains MoE layers under TP only with sequence parallelism) (4 processes). The
batch is test_megatron_layouts.py's: uneven groups, shared prompts, packed micro-batches, a full and a partial
step, `--lr 0`.

Negative control: EP rank 1 holds its two experts in swapped slots (the classic local → global index bug); its
loss and gradients must differ. The router's load-balancing loss: logged as `train/moe_load_balancing_loss` with
the loss term off (slime's forward hook) and on (megatron's own aux loss), the same number for the same forward;
with the term on, the router's gradient changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sim.rank_spawn import spawn_ranks
from sim.tiny_checkpoint import build_random_moe
from slime.utils.http_utils import find_free_port
from tests.unit.test_megatron_layouts import RTOL, SCHEDULE_METRICS, _args, _grad_error, _rel, _samples

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

WORLD = 4
AUX = 0.01
# name -> (processes, ep, cp, pp, --moe-aux-loss-coeff); "tp2sp" in the name: TP=2, --sequence-parallel, ETP=1
LAYOUTS = {
    "single": (1, 1, 1, 1, 0.0),
    "ep2": (2, 2, 1, 1, 0.0),
    "dp2": (2, 1, 1, 1, 0.0),
    "cp2": (2, 1, 2, 1, 0.0),
    "pp2": (2, 1, 1, 2, 0.0),
    "ep2cp2": (4, 2, 2, 1, 0.0),
    "ep2pp2": (4, 2, 1, 2, 0.0),
    "ep2tp2sp": (4, 2, 1, 1, 0.0),
    "ep2_swapped": (2, 2, 1, 1, 0.0),
    "single_aux": (1, 1, 1, 1, AUX),
}
# not layout-invariant by design: per micro-batch statistics of the router (micro-batches differ per DP layout)
PER_MICROBATCH = ("train/moe_load_balancing_loss",)


def _swap_local_experts(model) -> None:
    """The negative control: this rank's local experts 0 and 1 trade weights in every layer."""
    with torch.no_grad():
        for layer in model.decoder.layers:
            a, b = layer.mlp.experts.local_experts[0], layer.mlp.experts.local_experts[1]
            for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
                tmp = pa.detach().clone()
                pa.copy_(pb)
                pb.copy_(tmp)


def _run(rank: int, name: str, port: int, ckpt: str, out_dir: str) -> None:
    from slime.backends.megatron.arguments import validate_moe_args
    from slime.backends.megatron.hf_weights import iter_hf_tensors, layer_offset, unwrap_model
    from slime.backends.megatron.initialize import destroy_megatron
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer

    world, ep, cp, pp, aux = LAYOUTS[name]
    if rank >= world:
        return
    sp = "tp2sp" in name
    extra = ("--sequence-parallel", "--expert-tensor-parallel-size", "1") if sp else ()
    args = _args(ckpt, world, 2 if sp else 1, cp, pp, extra=extra)
    args.expert_model_parallel_size, args.moe_aux_loss_coeff = ep, aux
    validate_moe_args(args)  # the flag checks accept this layout
    trainer = MegatronTrainer(args, rank, world, "127.0.0.1", port)
    ps = trainer.ps
    chunk = unwrap_model(trainer.model)
    if name.endswith("_swapped") and ps.rank("ep") == 1:
        _swap_local_experts(chunk)
    parallel = {"dp_size": ps.size("dp"), "cp_size": ps.size("cp"), "pp_size": ps.size("pp"), "vpp_size": 1,
                "microbatch_group_size_per_vp_stage": None}  # fmt: skip
    data, _ = build_rank_data(args, 0, _samples(trainer.spec.vocab_size), CarryBuffer(), parallel)
    snapshots, step = [], trainer.optimizer.step

    def step_and_keep_grads():  # the DDP-reduced gradient of every optimizer step, before the update
        snapshots.append([(n, p.main_grad.detach().clone()) for n, p in chunk.named_parameters()])
        return step()

    trainer.optimizer.step = step_and_keep_grads
    metrics = trainer.train(0, data[ps.rank("dp")])
    grads = [{n: g.clone() for n, g in iter_hf_tensors(s, trainer.spec, ps, layer_offset(chunk))} for s in snapshots]
    if ps.rank("dp") == ps.rank("cp") == ps.rank("tp") == 0:  # one file per pipeline stage (its own layers' grads)
        layout = {d: ps.size(d) for d in ("dp", "ep", "tp", "etp", "cp", "pp")}
        layout["sp"] = chunk.config.sequence_parallel  # what megatron runs, not just the flag
        path = f"{out_dir}/{name}.pp{ps.rank('pp')}.pt"
        torch.save({"metrics": metrics, "grads": grads, "layout": layout}, path)
    destroy_megatron()


def _worker(rank: int, ports: dict[str, int], ckpt: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    for name in LAYOUTS:
        _run(rank, name, ports[name], ckpt, out_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_layouts")
    ckpt = str(root / "model")
    build_random_moe(Path(ckpt), "qwen2_moe", norm_topk_prob=True)
    ports = {name: find_free_port() for name in LAYOUTS}
    spawn_ranks(_worker, args=(ports, ckpt, str(root)), nprocs=WORLD, daemon=True)
    runs = {}
    for name, (*_, pp, _aux) in LAYOUTS.items():
        stages = [torch.load(root / f"{name}.pp{k}.pt") for k in range(pp)]
        grads = [{n: g for st in stages for n, g in st["grads"][i].items()} for i in range(len(stages[0]["grads"]))]
        runs[name] = {**stages[-1], "grads": grads}
    return runs


def test_layouts_are_what_they_claim(runs):
    for name, (world, ep, cp, pp, _) in LAYOUTS.items():
        tp = 2 if "tp2sp" in name else 1
        want = {"dp": world // (tp * cp * pp), "ep": ep, "tp": tp, "etp": 1, "cp": cp, "pp": pp, "sp": tp > 1}
        assert runs[name]["layout"] == want, name
    assert len(runs["single"]["grads"]) == 2  # a full and a partial step
    names = set(runs["single"]["grads"][0])
    assert sum(".mlp.experts." in n for n in names) == 2 * 4 * 3  # every expert's gate/up/down, both layers
    assert {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight"} <= names


@pytest.mark.parametrize("name", ["ep2", "dp2", "cp2", "pp2", "ep2cp2", "ep2pp2", "ep2tp2sp"])
def test_loss_metrics_and_gradients_equal_single_process(runs, name):
    want, got = runs["single"], runs[name]
    reduced = [k for k in want["metrics"] if k.startswith("train/") and k not in SCHEDULE_METRICS + PER_MICROBATCH]
    assert {"train/loss", "train/pg_loss", "train/entropy_loss", "train/ppo_kl", "train/grad_norm"} <= set(reduced)
    for k in reduced:
        if k == "train/ppo_kl":  # old − new log-probs of identical weights: 0 up to rounding
            assert abs(got["metrics"][k]) < 1e-6, (name, got["metrics"][k])
            continue
        assert _rel(got["metrics"][k], want["metrics"][k]) < RTOL, (name, k, got["metrics"][k], want["metrics"][k])
    for step, g in enumerate(want["grads"]):
        assert _grad_error(got["grads"][step], g) < RTOL, (name, step)
    experts = [n for n in want["grads"][0] if ".mlp.experts." in n]
    for n in experts:  # every expert got tokens, and so a gradient, in some step: all of them were compared
        assert max(float(g[n].abs().max()) for g in want["grads"]) > 0, n


def test_negative_control_swapped_experts_on_one_rank_differ(runs):
    want, got = runs["single"], runs["ep2_swapped"]
    assert _rel(got["metrics"]["train/loss"], want["metrics"]["train/loss"]) > 10 * RTOL
    assert _grad_error(got["grads"][0], want["grads"][0]) > 10 * RTOL


def test_load_balancing_loss_is_logged_and_optional(runs):
    plain, aux = runs["single"], runs["single_aux"]
    for name in LAYOUTS:
        value = runs[name]["metrics"]["train/moe_load_balancing_loss"]
        assert 0.5 < value < 4.0, (name, value)  # the switch loss is 1 when balanced, E / k = 2 at worst
    # slime's hook (term off) and megatron's aux loss (term on) measure the same forward alike
    assert (
        _rel(aux["metrics"]["train/moe_load_balancing_loss"], plain["metrics"]["train/moe_load_balancing_loss"]) < 1e-6
    )
    assert _rel(aux["metrics"]["train/loss"], plain["metrics"]["train/loss"]) < RTOL  # slime's loss is unchanged
    router = "model.layers.0.mlp.gate.weight"
    diff = float((aux["grads"][0][router] - plain["grads"][0][router]).abs().max())
    assert diff > 10 * RTOL * float(plain["grads"][0][router].abs().max())  # the term reaches the router
