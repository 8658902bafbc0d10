"""Same numbers in every parallel layout, through real megatron-core on gloo: `MegatronTrainer.train` on one
batch gives the loss, every reduced metric and every parameter's gradient (DDP-reduced, gathered over TP into
HF names, each pipeline stage's own layers) of the single-process run, for CP=2, CP=4, DP=2 x CP=2, PP=2,
PP=2 with 2 virtual stages, TP=2 x PP=2, PP=2 x CP=2, and TP=2 and TP=2 x PP=2 with sequence parallelism (rows
padded to a multiple of TP, norm gradients summed over TP by megatron's finalize_model_grads).

The batch has uneven groups (fan-out: 1-3 segments per trajectory), samples of one prompt that share its rows
(`--share-prompt-prefix`), partly masked responses, token-packed micro-batches and a full plus a partial
optimizer step. `--lr 0` keeps the weights fixed so every step sees the same model; the π_old log-prob pass runs
first, so `ppo_kl` (old − new, 0 when exact) also checks that log-probs come back in sample order. A negative
control runs CP=2 with one rank's segment boundaries shifted and must differ.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from sim.rank_spawn import spawn_ranks
from sim.tiny_checkpoint import build_random_qwen2
from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

SHIM = "sim.fake_megatron.cpu_shim.apply"
RTOL = 1e-5
WORLD = 4
# name -> (processes, tp, cp, pp); "vpp" in the name: 2 virtual stages per pipeline rank (4 layers, 1 per chunk);
# "sp" in the name: --sequence-parallel
# what the schedule did rather than what the loss is: CP packs micro-batches of up to cp x --max-tokens-per-gpu
SCHEDULE_METRICS = ("train/tokens_per_s", "train/packed_tokens_ratio", "train/samples")  # samples: this rank's
LAYOUTS = {
    "single": (1, 1, 1, 1), "cp2": (2, 1, 2, 1), "cp4": (4, 1, 4, 1), "dp2cp2": (4, 1, 2, 1), "pp2": (2, 1, 1, 2),
    "pp2vpp2": (2, 1, 1, 2), "tp2pp2": (4, 2, 1, 2), "pp2cp2": (4, 1, 2, 2), "tp2sp": (2, 2, 1, 1), "tp2pp2sp": (4, 2, 1, 2),
    "cp2_shifted": (2, 1, 2, 1),
}  # fmt: skip


def _args(ckpt: str, world: int, tp: int, cp: int, pp: int, vpp: bool = False, extra: tuple[str, ...] = ()):
    from slime.arguments import parse_args

    return parse_args([*(["--virtual-pipeline-model-parallel-size", "2"] if vpp else []), *extra,
        "--hf-checkpoint", ckpt, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--global-batch-size", "3", "--allow-partial-last-step", "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", "40", "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", str(world),
        "--lr", "0", "--weight-decay", "0", "--clip-grad", "1e9", "--entropy-coef", "0.01",
        "--rollout-temperature", "0.8", "--share-prompt-prefix", "--eps-clip-c", "3",
        "--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
        "--pipeline-model-parallel-size", str(pp),
        "--custom-megatron-init-path", SHIM,
    ])  # fmt: skip


def _samples(vocab: int) -> list:
    """4 trajectories from 2 prompts, fanned out into 1-3 segments; segments of one prompt share its tokens."""
    from slime.utils.types import Sample, Status

    rng = random.Random(5)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (7, 4)]
    out = []
    for g, (p, k) in enumerate([(0, 2), (0, 1), (1, 3), (1, 1)]):
        reward = rng.random()
        for _ in range(k):
            r = rng.randint(2, 11)
            mask = [int(rng.random() < 0.8) for _ in range(r)]
            mask[0] = 1
            out.append(
                Sample(index=len(out), group_index=p, group_id=100 + g, reward=reward,
                       tokens=prompts[p] + [rng.randrange(vocab) for _ in range(r)], response_length=r,
                       loss_mask=mask, status=Status.COMPLETED)
            )  # fmt: skip
    return out


def _shift_boundaries(trainer) -> None:
    """The negative control: on this rank, every packed row gets a segment boundary at the first local row that
    has earlier rows in its segment (those queries lose their causal context here only)."""
    pack = trainer._pack

    def shifted(mb):
        packed = pack(mb)
        segs = packed.packed_seq_params._slime_segments
        for r in packed.cp_rows.tolist():
            real = packed.total_len - packed.pad  # not the padding segment: no sample reads it
            hit = [k for k, (qs, n, _, _) in enumerate(segs) if qs < r < qs + n and qs < real]
            if hit:
                qs, n, p0, pl = segs[hit[0]]
                segs[hit[0] : hit[0] + 1] = [(qs, r - qs, p0, pl), (r, qs + n - r, p0, pl)]
                break
        return packed

    trainer._pack = shifted


def _run(rank: int, name: str, port: int, ckpt: str, out_dir: str) -> None:
    from slime.backends.megatron.hf_weights import iter_hf_tensors, layer_offset, unwrap_model
    from slime.backends.megatron.initialize import destroy_megatron
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer

    world, tp, cp, pp = LAYOUTS[name]
    if rank >= world:
        return
    args = _args(ckpt, world, tp, cp, pp, vpp="vpp" in name, extra=("--sequence-parallel",) if "sp" in name else ())
    trainer = MegatronTrainer(args, rank, world, "127.0.0.1", port)
    ps = trainer.ps
    if name.endswith("_shifted") and ps.rank("cp") == 1:
        _shift_boundaries(trainer)
    parallel = {  # what the train actor reports to the scheduler (TrainBackend.parallel_config)
        "dp_size": ps.size("dp"), "cp_size": ps.size("cp"), "pp_size": ps.size("pp"),
        "vpp_size": args.virtual_pipeline_model_parallel_size or 1,
        "microbatch_group_size_per_vp_stage": args.microbatch_group_size_per_vp_stage,
    }  # fmt: skip
    data, _ = build_rank_data(args, 0, _samples(trainer.spec.vocab_size), CarryBuffer(), parallel)
    chunks = [unwrap_model(c) for c in trainer.chunks]  # one, or one per virtual stage
    snapshots, step = [], trainer.optimizer.step

    def step_and_keep_grads():  # the DDP-reduced gradient of every optimizer step, before the update
        snapshots.append([[(n, p.main_grad.detach().clone()) for n, p in c.named_parameters()] for c in chunks])
        return step()

    trainer.optimizer.step = step_and_keep_grads
    metrics = trainer.train(0, data[ps.rank("dp")])
    grads = [
        {
            n: g.clone()
            for c, named in zip(chunks, s, strict=True)
            for n, g in iter_hf_tensors(named, trainer.spec, ps, layer_offset(c))
        }
        for s in snapshots
    ]
    # one file per pipeline stage (each holds its own layers' gradients), from its first rank
    if ps.rank("tp") == ps.rank("dp") == ps.rank("cp") == 0:
        layout = {d: ps.size(d) for d in ("dp", "tp", "cp", "pp")}
        layout["sp"] = all(c.config.sequence_parallel for c in chunks)  # what megatron runs, not just the flag
        path = f"{out_dir}/{name}.pp{ps.rank('pp')}.pt"
        torch.save({"metrics": metrics, "grads": grads, "layout": layout}, path)
    destroy_megatron()


def _worker(rank: int, ports: dict[str, int], ckpt: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    for name in LAYOUTS:
        _run(rank, name, ports[name], ckpt, out_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    ckpt = str(root / "model")
    build_random_qwen2(Path(ckpt), num_layers=4)
    ports = {name: find_free_port() for name in LAYOUTS}
    spawn_ranks(_worker, args=(ports, ckpt, str(root)), nprocs=WORLD, daemon=True)
    runs = {}
    for name, (*_, pp) in LAYOUTS.items():
        stages = [torch.load(root / f"{name}.pp{k}.pt") for k in range(pp)]
        grads = [
            {n: g for st in stages for n, g in st["grads"][step].items()} for step in range(len(stages[0]["grads"]))
        ]
        runs[name] = {**stages[-1], "grads": grads, "stage_metrics": [st["metrics"] for st in stages]}
    return runs


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-6)


def _grad_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), set(got) ^ set(want)
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 1e-3  # a real gradient, not numerical noise
    return max(float((got[n] - want[n]).abs().max()) for n in want) / scale


def test_layouts_are_what_they_claim(runs):
    for name, (world, tp, cp, pp) in LAYOUTS.items():
        want = {"dp": world // (tp * cp * pp), "tp": tp, "cp": cp, "pp": pp, "sp": "sp" in name}
        assert runs[name]["layout"] == want, name
    assert len(runs["single"]["grads"]) == 2  # a full and a partial step
    assert runs["single"]["metrics"]["train/packed_tokens_ratio"] < 1.0  # prompts really shared rows


@pytest.mark.parametrize("name", ["cp2", "cp4", "dp2cp2", "pp2", "pp2vpp2", "tp2pp2", "pp2cp2", "tp2sp", "tp2pp2sp"])
def test_loss_metrics_and_gradients_equal_single_process(runs, name):
    want, got = runs["single"], runs[name]
    reduced = [k for k in want["metrics"] if k.startswith("train/") and k not in SCHEDULE_METRICS]
    assert {"train/loss", "train/pg_loss", "train/entropy_loss", "train/ppo_kl", "train/grad_norm"} <= set(reduced)
    for k in reduced:
        if k == "train/ppo_kl":  # old − new log-probs of identical weights: 0 up to rounding
            assert abs(got["metrics"][k]) < 1e-6, (name, got["metrics"][k])
            continue
        assert _rel(got["metrics"][k], want["metrics"][k]) < RTOL, (name, k, got["metrics"][k], want["metrics"][k])
    for step, g in enumerate(want["grads"]):
        assert _grad_error(got["grads"][step], g) < RTOL, (name, step)
    for stage in got["stage_metrics"]:  # every pipeline stage reports the last stage's numbers
        assert stage["train/loss"] == got["metrics"]["train/loss"]


def test_negative_control_shifted_boundaries_on_one_rank_differ(runs):
    want, got = runs["single"], runs["cp2_shifted"]
    assert _rel(got["metrics"]["train/loss"], want["metrics"]["train/loss"]) > 10 * RTOL
    assert _grad_error(got["grads"][0], want["grads"][0]) > 10 * RTOL
