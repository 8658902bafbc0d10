"""The groups core through the real trainer: `MegatronTrainer.train` under DP=2, TP=2 and TP=1 (gloo, CPU) gives
the loss and the gradients of the simulated DP=2 run and of a per-token reference loop.

The batch has uneven groups (fan-out: 1-3 segments per trajectory, from two prompts), partly masked responses,
token-packed micro-batches (some ranks get empty ones) and two optimizer steps of b=3 and b=1 groups
(`--allow-partial-last-step`). `--lr 0` keeps the weights fixed, so every step of every layout sees the same
model; the gradients compared are those of the last step, read from megatron's DDP buffers (`main_grad`,
averaged over dp, gathered over tp into HF names).

Three independent ways to get the same numbers:
- real: megatron-core's forward-backward schedule, `scale_for_megatron`, DDP all-reduce, 2 spawned ranks;
- simulated: `sim.fake_megatron.SimulatedWorld` with dp=2 running an HF copy of the model per rank, the
  production schedule, loss and pre-scale, then dividing by the micro-batch count and averaging over dp as
  Megatron does (tests/property/test_layout_invariance.py proves that chain on synthetic terms);
- reference: one loop per group and token over the HF model: L_s = (1/b) Σ_g Σ_{i∈g,t} m·x / D_g.
A negative control (per-sample instead of per-group token means) must differ from all of them.
"""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import pytest
import torch

from sim.rank_spawn import spawn_ranks
from sim.tiny_checkpoint import build_random_qwen2
from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

SHIM = "sim.fake_megatron.cpu_shim.apply"
TEMPERATURE = 0.8
ENTROPY_COEF = 0.01
LOSS_TOL = 1e-5
GRAD_RTOL = 1e-4  # of the largest gradient entry
LAYOUTS = ("dp2", "tp2", "tp1")
PER_TOKEN_LAYOUTS = ("dp2_pt", "tp1_pt")  # --calculate-per-token-loss
METRIC_NAMES = ("entropy_loss", "loss", "pg_clipfrac", "pg_loss", "ppo_kl")  # what policy_loss reports here


def _args(ckpt: str, tp: int, per_token: bool = False):
    from slime.arguments import parse_args

    return parse_args([*(["--calculate-per-token-loss"] if per_token else []),
        "--hf-checkpoint", ckpt, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--global-batch-size", "3", "--allow-partial-last-step", "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", "24", "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "2",
        "--lr", "0", "--weight-decay", "0", "--clip-grad", "1e9", "--entropy-coef", str(ENTROPY_COEF),
        "--rollout-temperature", str(TEMPERATURE), "--tensor-model-parallel-size", str(tp),
        "--custom-megatron-init-path", SHIM,
    ])  # fmt: skip


def _samples(vocab: int) -> list:
    """4 trajectories (groups) from 2 prompts; each fans out into 1-3 segments with partly masked responses."""
    from slime.utils.types import Sample, Status

    rng = random.Random(3)
    out = []
    for g, (prompt, k) in enumerate([(0, 2), (0, 1), (1, 3), (1, 1)]):
        reward = rng.random()
        for _ in range(k):
            p, r = rng.randint(2, 6), rng.randint(2, 9)
            mask = [int(rng.random() < 0.8) for _ in range(r)]
            mask[0] = 1
            out.append(
                Sample(index=len(out), group_index=prompt, group_id=100 + g, reward=reward,
                       tokens=[rng.randrange(vocab) for _ in range(p + r)], response_length=r, loss_mask=mask,
                       status=Status.COMPLETED)
            )  # fmt: skip
    return out


def _rank_data(args, vocab: int, dp: int) -> list[dict]:
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer

    data, _ = build_rank_data(args, 0, _samples(vocab), CarryBuffer(), {"dp_size": dp, "cp_size": 1})
    return data


# ---------------------------------------------------------------- real megatron (spawned ranks)


def _train_layout(rank: int, world: int, port: int, ckpt: str, tp: int, out: str, per_token: bool = False) -> None:
    from slime.backends.megatron.hf_weights import iter_hf_tensors, layer_offset, unwrap_model
    from slime.backends.megatron.initialize import destroy_megatron
    from slime.backends.megatron.trainer import MegatronTrainer

    args = _args(ckpt, tp, per_token)
    trainer = MegatronTrainer(args, rank, world, "127.0.0.1", port)
    ps = trainer.ps
    data = _rank_data(args, trainer.spec.vocab_size, ps.size("dp"))
    module = unwrap_model(trainer.model)
    snapshots, step = [], trainer.optimizer.step

    def step_and_keep_grads():  # the DDP-reduced gradient of every optimizer step, before the update
        snapshots.append([(n, p.main_grad.detach().clone()) for n, p in module.named_parameters()])
        return step()

    trainer.optimizer.step = step_and_keep_grads
    metrics = trainer.train(0, data[ps.rank("dp")])
    grads = [
        {n: g.clone() for n, g in iter_hf_tensors(snap, trainer.spec, ps, layer_offset(module))} for snap in snapshots
    ]
    if rank == 0:
        torch.save({"metrics": metrics, "grads": grads, "dp": ps.size("dp"), "tp": ps.size("tp")}, out)
    destroy_megatron()


def _worker(rank: int, ports: list[int], ckpt: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    _train_layout(rank, 2, ports[0], ckpt, 1, os.path.join(out_dir, "dp2.pt"))
    _train_layout(rank, 2, ports[1], ckpt, 2, os.path.join(out_dir, "tp2.pt"))
    _train_layout(rank, 2, ports[3], ckpt, 1, os.path.join(out_dir, "dp2_pt.pt"), per_token=True)
    if rank == 0:  # the single-rank runs: a world of their own
        _train_layout(0, 1, ports[2], ckpt, 1, os.path.join(out_dir, "tp1.pt"))
        _train_layout(0, 1, ports[4], ckpt, 1, os.path.join(out_dir, "tp1_pt.pt"), per_token=True)


# ---------------------------------------------------------------- simulated dp=2 and the reference loop


def _hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()


def _simulated(args, ckpt: str, vocab: int) -> dict:
    """SimulatedWorld dp=2: production schedule/loss/pre-scale on HF copies, Megatron's /K and DP average."""
    from transformers import AutoModelForCausalLM

    from sim.fake_megatron import SimulatedWorld
    from slime.algorithms.advantages import compute_advantages_and_returns
    from slime.algorithms.logprobs import response_logprobs_and_entropy
    from slime.algorithms.loss import loss_function
    from slime.algorithms.reducers import reduce_train_metrics, scale_for_megatron

    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    data = _rank_data(args, vocab, 2)

    def logprobs(model, mb, ps):
        logits = torch.cat([_hf_logits(model, t) for t in mb["tokens"]])
        toks = [torch.tensor(t) for t in mb["tokens"]]
        return response_logprobs_and_entropy(
            logits, toks, mb["total_lengths"], mb["response_lengths"], ps, temperature=TEMPERATURE
        )

    def rank_fn(ps):
        model = copy.deepcopy(base)
        d = data[ps.rank("dp")]
        mbs = [{k: [d[k][i] for i in idx] for k in ("tokens", "total_lengths", "response_lengths", "loss_masks",
                                                     "group_mask_sums", "rewards")} for idx in d["micro_batch_indices"]]  # fmt: skip
        for mb in mbs:
            if mb["tokens"]:
                with torch.no_grad():
                    mb["log_probs"] = [x.detach() for x in logprobs(model, mb, ps)[0]]
                mb["loss_masks"] = [torch.tensor(m, dtype=torch.float32) for m in mb["loss_masks"]]
                batch = {k: mb[k] for k in ("rewards", "loss_masks", "response_lengths", "total_lengths", "log_probs")}
                compute_advantages_and_returns(args, batch, ps)
                mb["advantages"] = batch["advantages"]
        steps, start = [], 0
        for n_mb, b in zip(d["num_microbatches"], d["global_batch_sizes"], strict=True):
            model.zero_grad(set_to_none=False)
            sums: dict[str, float] = {}
            for mb in mbs[start : start + n_mb]:
                if not mb["tokens"]:
                    continue  # an empty micro-batch: Megatron runs a zero loss, which adds nothing
                lp, ent = logprobs(model, mb, ps)
                loss, m = loss_function(args, mb, lp, ent, ps)
                scaled, _ = scale_for_megatron(
                    loss, num_microbatches=n_mb, global_batch_size=b, dp_cp_size=2, cp_size=1
                )
                (scaled / n_mb).backward()  # Megatron divides each micro-batch loss by num_microbatches
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
            start += n_mb
            for k in METRIC_NAMES:  # a rank with only empty micro-batches reports zeros (as the trainer does)
                sums.setdefault(k, 0.0)
            grads = {n: ps.all_reduce(p.grad.detach().clone(), "avg", "dp") for n, p in model.named_parameters()}
            steps.append({"metrics": reduce_train_metrics(sums, ps, global_batch_size=b), "grads": grads})
        return steps

    return SimulatedWorld(2).run(rank_fn)[0]


def _reference(args, ckpt: str, vocab: int, per_sample_mean: bool = False, per_token: bool = False) -> list[dict]:
    """Per-token loops over groups: L_s and its gradient for each step (π_old = π, so the ratio is 1). With
    `per_token`, every masked token of the step weighs the same: the sum over them divided by their count
    (a sample with no masked token counts as one)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    data = _rank_data(args, vocab, 1)[0]  # the normalised rewards and the step split, from the rollout side
    steps, start = [], 0
    for b, n_mb in zip(data["global_batch_sizes"], data["num_microbatches"], strict=True):
        idx = [i for mb in data["micro_batch_indices"][start : start + n_mb] for i in mb]
        start += n_mb
        model.zero_grad(set_to_none=False)
        groups: dict[int, list[int]] = {}
        for i in idx:
            groups.setdefault(data["group_ids"][i], []).append(i)
        assert len(groups) == b
        total = pg_total = ent_total = 0.0
        step_tokens = sum(max(sum(data["loss_masks"][i]), 1) for i in idx)
        for members in groups.values():
            denom = sum(sum(data["loss_masks"][i]) for i in members)
            for i in members:
                toks, n = data["tokens"][i], data["response_lengths"][i]
                logp = torch.log_softmax(_hf_logits(model, toks) / TEMPERATURE, dim=-1)
                d = sum(data["loss_masks"][i]) if per_sample_mean else denom
                if per_token:
                    d = step_tokens / b  # cancels the 1/b below: one mean over the step's tokens
                for t in range(n):
                    if not data["loss_masks"][i][t]:
                        continue
                    pos = len(toks) - n + t - 1  # the logits row that predicts response token t
                    lp = logp[pos, toks[pos + 1]]
                    pg = -data["rewards"][i] * torch.exp(lp - lp.detach())
                    ent = -(logp[pos].exp() * logp[pos]).sum()
                    pg_total = pg_total + pg / d / b
                    ent_total = ent_total + ent / d / b
        total = pg_total - ENTROPY_COEF * ent_total
        total.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        steps.append({"loss": total.item(), "pg_loss": pg_total.item(), "entropy_loss": ent_total.item(),
                      "grads": grads})  # fmt: skip
    return steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from slime.backends.megatron.hf_config import read_hf_config

    root = tmp_path_factory.mktemp("reducer_dp")
    ckpt = str(root / "model")
    build_random_qwen2(Path(ckpt), num_layers=2)
    # daemon: should the test be interrupted, the ranks die with it (a failing rank makes spawn stop the other)
    spawn_ranks(_worker, args=([find_free_port() for _ in range(5)], ckpt, str(root)), nprocs=2, daemon=True)
    vocab = read_hf_config(ckpt).vocab_size
    args = _args(ckpt, 1)
    return {
        "real": {k: torch.load(root / f"{k}.pt") for k in (*LAYOUTS, *PER_TOKEN_LAYOUTS)},
        "ref_per_token": _reference(_args(ckpt, 1, per_token=True), ckpt, vocab, per_token=True),
        "sim": _simulated(args, ckpt, vocab),
        "ref": _reference(args, ckpt, vocab),
        "naive": _reference(args, ckpt, vocab, per_sample_mean=True),
        "data": {dp: _rank_data(args, vocab, dp) for dp in (1, 2)},
    }


def _grad_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), set(got) ^ set(want)
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 1e-3  # a real gradient, not numerical noise
    return max(float((got[n] - want[n]).abs().max()) for n in want) / scale


def test_the_batch_exercises_uneven_groups_partial_steps_and_empty_microbatches(runs):
    one, two = runs["data"][1][0], runs["data"][2]
    assert one["global_batch_sizes"] == [3, 1]  # a full step and a partial last step of one sample
    assert len(set(one["group_ids"])) == 4 and len(one["tokens"]) == 7
    assert sum(len(d["tokens"]) for d in two) == 7
    assert any(not idx for d in two for idx in d["micro_batch_indices"]), "no rank got an empty micro-batch"
    assert max(len(idx) for idx in one["micro_batch_indices"]) > 1  # micro-batches really pack samples
    for k in LAYOUTS:
        r = runs["real"][k]
        assert (r["dp"], r["tp"]) == {"dp2": (2, 1), "tp2": (1, 2), "tp1": (1, 1)}[k]


def test_losses_equal_across_layouts_simulation_and_reference(runs):
    ref = runs["ref"]
    for name in ("loss", "pg_loss", "entropy_loss"):
        want = sum(s[name] for s in ref) / len(ref)  # the trainer reports the mean over its steps
        sim = sum(s["metrics"][name] for s in runs["sim"]) / len(runs["sim"])
        assert abs(sim - want) < LOSS_TOL, (name, sim, want)
        for k in LAYOUTS:
            got = runs["real"][k]["metrics"][f"train/{name}"]
            assert abs(got - want) < LOSS_TOL, (k, name, got, want)
    assert runs["real"]["tp1"]["metrics"]["train/global_batch_size"] == 2.0  # mean of b over the two steps
    norms = [runs["real"][k]["metrics"]["train/grad_norm"] for k in LAYOUTS]
    assert norms[0] > 0 and max(norms) - min(norms) < 1e-4 * norms[0], norms


def test_gradients_equal_across_layouts_simulation_and_reference(runs):
    for step, ref in enumerate(runs["ref"]):
        want = ref["grads"]
        assert _grad_error(runs["sim"][step]["grads"], want) < GRAD_RTOL, step
        for k in LAYOUTS:
            got = runs["real"][k]["grads"]
            assert len(got) == len(runs["ref"])
            assert _grad_error(got[step], want) < GRAD_RTOL, (k, step)


def test_negative_control_per_sample_means_differ(runs):
    ref, naive = runs["ref"], runs["naive"]
    assert abs(ref[0]["loss"] - naive[0]["loss"]) > 100 * LOSS_TOL  # step 1 has fanned-out groups
    got = runs["real"]["dp2"]
    assert abs(got["metrics"]["train/loss"] - sum(s["loss"] for s in naive) / len(naive)) > 100 * LOSS_TOL
    assert _grad_error(got["grads"][0], naive[0]["grads"]) > 100 * GRAD_RTOL


def test_per_token_loss_is_one_mean_over_the_steps_tokens_in_every_layout(runs):
    """--calculate-per-token-loss: the same gradient however the step is split into micro-batches and ranks."""
    ref, grouped = runs["ref_per_token"], runs["ref"]
    for step, want in enumerate(ref):
        for k in PER_TOKEN_LAYOUTS:
            got = runs["real"][k]["grads"]
            assert len(got) == len(ref)
            assert _grad_error(got[step], want["grads"]) < GRAD_RTOL, (k, step)
    for k in PER_TOKEN_LAYOUTS:
        got = runs["real"][k]["metrics"]["train/loss"]
        want = sum(s["loss"] for s in ref) / len(ref)
        assert abs(got - want) < LOSS_TOL, (k, got, want)
    assert _grad_error(ref[0]["grads"], grouped[0]["grads"]) > 100 * GRAD_RTOL  # the two modes differ here
