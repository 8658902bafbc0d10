"""An independent GRPO on the toy task (plain PyTorch + the HF model), to cross-check slime and sweep RL settings.

It shares no code with slime's trainer, rollout or losses (only the toy reward), so where it agrees with
`bench.toy_learning` that is evidence, and a sweep costs about 1 s per step on one CPU core instead of ~4 s.

    .venv/bin/python -m bench.toy_grpo_reference --checkpoint runs/toy_learning/sft/hf_79 --out runs/ref/a.jsonl \
        [--reward toy|random] [--lr 5e-4 --warmup 30 --kl 0.2 ...]
    .venv/bin/python -m bench.toy_grpo_reference --sweep bench/toy_grpo_sweep.txt --out-dir runs/ref --jobs 2 \
        --checkpoint ... [--steps 120] [--random-seeds 4] [--no-toy] [--max-seconds 400] [--device cuda --eval-n 8]
        # every line "name flags": one run with the toy reward, --random-seeds runs with a fair coin
    .venv/bin/python -m bench.toy_grpo_reference --summarise runs/ref

The recipe mirrors the bench's RL runs: prompts through the chat template, T=1.0 sampling, stop on the
checkpoint's EOS ids, at most 12 new tokens; GRPO advantages (unbiased std, eps 1e-6); loss = mean over samples
of the per-sample token mean (slime's default reducer for one-segment trajectories); optional low_var_kl to the
start weights; AdamW (weight decay 0.01 on matrices), linear warm-up, clip-grad 1.0. Eval: the 256 held-out
prompts x `--eval-n` (2) at T=1.0 every 5 steps, with the same sampling seeds at every eval (common random numbers).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from examples.toy.reward import score_reverse

logger = logging.getLogger("bench.toy_grpo_reference")
ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 12


class Task:
    """Tokenised prompts and labels plus a decoder, from the bench's workdir layout."""

    def __init__(self, checkpoint: Path, data_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(checkpoint)
        self.train = self._load(data_dir / "train.jsonl")
        self.eval = self._load(data_dir / "eval.jsonl")
        gen = json.loads((checkpoint / "generation_config.json").read_text())
        eos = gen.get("eos_token_id", self.tok.eos_token_id)
        self.eos = sorted({*(eos if isinstance(eos, list) else [eos]), self.tok.eos_token_id})
        self.pad = self.tok.pad_token_id or 0

    def _load(self, path: Path) -> list[tuple[list[int], str]]:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out = []
        for r in rows:
            text = self.tok.apply_chat_template(r["input"], add_generation_prompt=True, tokenize=False)
            out.append((self.tok(text, add_special_tokens=False)["input_ids"], str(r["label"])))
        return out

    def reward(self, response_ids: list[int], label: str) -> float:
        return score_reverse(self.tok.decode(response_ids, skip_special_tokens=True), label)


@torch.no_grad()
def sample(model: Any, task: Task, prompts: list[list[int]], n: int, seed: int) -> tuple[list, list, list]:
    """n samples per prompt at T=1 with a KV cache; returns (prompts, responses incl. EOS, truncated flags)."""
    dev = model.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    ps = [p for p in prompts for _ in range(n)]
    b, width = len(ps), max(len(p) for p in ps)
    ids = torch.full((b, width), task.pad)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(ps):  # left padding, positions counted from each prompt's first token
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    eos = torch.tensor(task.eos, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    steps, last = [], pos[:, -1:]
    for _ in range(MAX_NEW):
        t = torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1, generator=gen).squeeze(1)
        steps.append(torch.where(done, -1, t))
        done |= torch.isin(t, eos)
        if bool(done.all()):
            break
        mask, last = torch.cat([mask, torch.ones((b, 1), dtype=torch.long, device=dev)], 1), last + 1
        out = model(input_ids=t[:, None], attention_mask=mask, position_ids=last, past_key_values=out.past_key_values)
    resps = [[x for x in row if x >= 0] for row in torch.stack(steps, 1).tolist()]
    return ps, resps, [not (r and r[-1] in task.eos) for r in resps]


def token_logps(model: Any, task: Task, ps: list, rs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log-prob of the next token and the response mask, right-padded."""
    lens = [len(p) + len(r) for p, r in zip(ps, rs, strict=True)]
    ids = torch.full((len(ps), max(lens)), task.pad)
    resp = torch.zeros(ids.shape)
    for i, (p, r) in enumerate(zip(ps, rs, strict=True)):
        ids[i, : lens[i]] = torch.tensor(p + r)
        resp[i, len(p) : lens[i]] = 1
    att = (torch.arange(ids.shape[1])[None] < torch.tensor(lens)[:, None]).long()
    ids, resp, att = ids.to(model.device), resp.to(model.device), att.to(model.device)
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1), resp[:, 1:]


def run(a: argparse.Namespace) -> None:
    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)  # still accepted
    ckpt = Path(a.checkpoint)
    task = Task(ckpt, Path(a.data_dir) if a.data_dir else ckpt.parents[1] / "assets" / "data")
    model = Qwen2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(a.device)
    ref = Qwen2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(a.device).eval() if a.kl else None
    params = list(model.parameters())
    groups = [
        {"params": [q for q in params if q.dim() > 1], "weight_decay": 0.01},
        {"params": [q for q in params if q.dim() <= 1], "weight_decay": 0.0},
    ]
    if a.optimizer == "sgd":  # sweep s10: slower GRPO and 2-4x the coin run's drift of Adam (docs/performance.md)
        opt = torch.optim.SGD(groups, lr=a.lr, momentum=a.momentum)
    else:
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / a.warmup) if a.warmup else 1.0)
    order = torch.randperm(len(task.train), generator=torch.Generator().manual_seed(a.seed)).tolist()
    coin = torch.Generator().manual_seed(a.seed + 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(a.out, "w") as log:
        for step in tqdm(range(a.steps + 1), desc=Path(a.out).stem, disable=a.quiet):
            if step % 5 == 0:
                model.eval()
                _, rs, tr = sample(model, task, [p for p, _ in task.eval], a.eval_n, seed=10_000)
                labels = [lab for _, lab in task.eval for _ in range(a.eval_n)]
                rew = [task.reward(r, lab) for r, lab in zip(rs, labels, strict=True)]
                rec = {"kind": "eval", "step": step, "eval": sum(rew) / len(rew), "truncated": sum(tr) / len(tr)}
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if step == a.steps or (step % 5 == 0 and a.max_seconds and time.monotonic() - t0 > a.max_seconds):
                break
            batch = [task.train[order[(step * a.batch + i) % len(order)]] for i in range(a.batch)]
            model.eval()
            ps, rs, tr = sample(model, task, [p for p, _ in batch], a.n, seed=a.seed * 1_000_003 + step)
            model.train()
            if a.reward == "toy":
                labels = [lab for _, lab in batch for _ in range(a.n)]
                r = torch.tensor([task.reward(x, lab) for x, lab in zip(rs, labels, strict=True)], dtype=torch.float64)
            else:  # slime's `--rm-type random`: a fair coin per sample, independent of the response
                r = (torch.rand(len(rs), generator=coin) < 0.5).double()
            g = r.view(a.batch, a.n).to(a.device)
            adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1).float()
            lp, m = token_logps(model, task, ps, rs)
            x = -adv[:, None] * lp  # on-policy, one step per rollout: the PPO ratio is 1, its gradient is ∇logp
            kl = torch.zeros(())
            if ref is not None:
                with torch.no_grad():
                    rlp, _ = token_logps(ref, task, ps, rs)
                d = (rlp - lp).clamp(-20, 20)
                k3 = (torch.exp(d) - d - 1).clamp(-10, 10)  # low_var_kl (k3, clamped)
                x = x + a.kl * k3
                kl = (k3 * m).sum().detach() / m.sum()
            if a.per_token:  # one token mean over the whole batch (slime's --calculate-per-token-loss)
                loss = (x * m).sum() / m.sum().clamp(min=1)
            else:  # mean over samples of each sample's token mean
                loss = ((x * m).sum(1) / m.sum(1).clamp(min=1)).mean()
            opt.zero_grad()
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, a.clip_grad)
            opt.step()
            sched.step()
            rec = {"kind": "train", "step": step, "reward": float(r.mean()), "grad_norm": float(gn),
                   "kl": float(kl), "response_len": float(m.sum(1).mean())}  # fmt: skip
            log.write(json.dumps({**rec, "truncated": sum(tr) / len(tr)}) + "\n")


def _evals(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if '"eval"' in x]


def summarise(out_dir: Path, target: float = 0.9, tol: float = 0.05) -> list[dict[str, Any]]:
    """Per config: first step at the target (toy reward); each random run's max |eval - start| up to that step
    and over the whole run (random runs are `__random.jsonl` or `__random_s<seed>.jsonl`)."""
    rows = []
    for name in sorted({f.name.split("__")[0] for f in out_dir.glob("*__*.jsonl")}):
        toy = out_dir / f"{name}__toy.jsonl"
        curve = _evals(toy) if toy.exists() else []
        first = next((e["step"] for e in curve if e["eval"] >= target), None)
        horizon = first if first is not None else (curve[-1]["step"] if curve else float("inf"))
        devs_h, devs_full = [], []
        for rnd_path in sorted(out_dir.glob(f"{name}__random*.jsonl")):
            rnd = _evals(rnd_path)
            if rnd:
                devs_h.append(max(abs(e["eval"] - rnd[0]["eval"]) for e in rnd if e["step"] <= horizon))
                devs_full.append(max(abs(e["eval"] - rnd[0]["eval"]) for e in rnd))
        rows.append(
            {"config": name, "start": curve[0]["eval"] if curve else None, "final": curve[-1]["eval"] if curve else None,
             "steps": curve[-1]["step"] if curve else 0, "first_step_at_target": first,
             "random_runs": len(devs_full),
             "random_max_abs_dev_to_horizon": max(devs_h, default=None),
             "random_max_abs_dev_full": max(devs_full, default=None),
             "random_dev_full_per_seed": [round(d, 3) for d in devs_full],
             "random_within_tol": bool(devs_full) and max(devs_full) <= tol}
        )  # fmt: skip
    print(f"{'config':<34} {'start':>6} {'final':>6} {'steps':>5} {'>=tgt':>6} {'rnd dev (horizon/full, per seed)'}")
    for r in rows:
        dev = "-"
        if r["random_runs"]:
            dev = f"{r['random_max_abs_dev_to_horizon']:.3f}/{r['random_max_abs_dev_full']:.3f} "
            dev += str(r["random_dev_full_per_seed"])
        print(f"{r['config']:<34} {r['start'] or 0:>6.3f} {r['final'] or 0:>6.3f} {r['steps']:>5} "
              f"{str(r['first_step_at_target']):>6} {dev}")  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def sweep(a: argparse.Namespace) -> None:
    lines = [x.split(None, 1) for x in Path(a.sweep).read_text().splitlines() if x.strip() and not x.startswith("#")]
    jobs = []
    for name, *rest in lines:
        runs = [] if a.no_toy else [("toy", "toy", 0)]
        runs += [("random", "random" if a.random_seeds == 1 else f"random_s{k}", k) for k in range(a.random_seeds)]
        for reward, tag, seed in runs:
            out = Path(a.out_dir) / f"{name}__{tag}.jsonl"
            jobs.append([sys.executable, "-m", "bench.toy_grpo_reference", "--checkpoint", a.checkpoint,
                         "--steps", str(a.steps), "--reward", reward, "--out", str(out), "--quiet",
                         "--seed", str(seed), "--max-seconds", str(a.max_seconds), "--device", a.device,
                         "--eval-n", str(a.eval_n), *shlex.split(rest[0] if rest else "")])  # fmt: skip
    with ThreadPoolExecutor(a.jobs) as pool, tqdm(total=len(jobs), desc="sweep") as bar:
        for rc in pool.map(lambda cmd: subprocess.run(cmd, cwd=ROOT).returncode, jobs):
            bar.update(1)
            if rc:
                logger.warning("a sweep run failed (rc=%d)", rc)
    summarise(Path(a.out_dir))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="runs/toy_learning/sft/hf_79", help="RL start (HF dir)")
    p.add_argument("--data-dir", default=None, help="train/eval.jsonl (default: the bench workdir's)")
    p.add_argument("--out", help="metrics JSONL of one run")
    p.add_argument("--reward", choices=["toy", "random"], default="toy")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--per-token", action="store_true", help="token mean over the batch, not per sample")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--kl", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=64, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda to sweep on a GPU host")
    p.add_argument("--eval-n", type=int, default=2, help="eval samples per held-out prompt")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--max-seconds", type=float, default=0, help="stop (after an eval) once this much wall time passed")
    p.add_argument("--sweep", help="file of 'name flags' lines")
    p.add_argument("--out-dir", default="runs/toy_grpo_reference")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--no-toy", action="store_true", help="sweep only the random-reward runs")
    p.add_argument("--random-seeds", type=int, default=1, help="random-reward runs per config (seeds 0..N-1)")
    p.add_argument("--summarise", help="print and write the summary of a sweep directory")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if a.summarise:
        summarise(Path(a.summarise))
    elif a.sweep:
        sweep(a)
    elif a.out:
        run(a)
    else:
        p.error("give --out, --sweep or --summarise")


if __name__ == "__main__":
    main()
