"""A memory accountant: one colocated RL step replayed as allocation events on every simulated rank's GPU and host.

Each simulated rank holds processes — the engine, the actor and (PPO) the critic — and every buffer they make is
an event: `alloc` / `free` of named tensors, `pause` / `resume` of an offload region (backed-up bytes move to the
host and back, the others are dropped and re-made), the pinned weight copy of the default policy, the engine's
release and resume. Buffers are sized from the tensors megatron-core would build on that rank (each parameter's
TP shard on its pipeline stage, the flat grad buffer, the optimizer's DP shard of it) and activations from the
tensors a micro-batch leaves alive, layer by layer. The replay runs start-up and two steps; the second step's
per-phase peaks are what a steady-state step costs, which `slime.backends.megatron.memory.build_memory_plan`
predicts in closed form (tests/property/test_memory_plan.py checks the two agree).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from sim.fake_megatron.sim_world import SimulatedWorld
from slime.backends.megatron.memory import MemoryConfig, ModelShape

logger = logging.getLogger(__name__)


def megatron_param_shapes(
    shape: ModelShape, tp: int, pp: int, pp_rank: int, critic: bool
) -> Iterator[tuple[str, int]]:
    """(name, numel) of every parameter of one rank, as megatron-core's local-spec GPTModel shards them."""
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.kv_channels
    heads, groups = shape.num_attention_heads, shape.num_query_groups
    vocab = -(-shape.vocab_size // tp) * tp
    layers = shape.num_layers // pp
    if pp_rank == 0:
        yield "embedding.word_embeddings.weight", vocab // tp * h
    for i in range(layers):
        pre = f"decoder.layers.{i}."
        yield pre + "input_layernorm.weight", h
        qkv_rows = (heads // tp + 2 * groups // tp) * d
        yield pre + "self_attention.linear_qkv.weight", qkv_rows * h
        if shape.qkv_bias:
            yield pre + "self_attention.linear_qkv.bias", qkv_rows
        if shape.qk_layernorm:
            yield pre + "self_attention.q_layernorm.weight", d
            yield pre + "self_attention.k_layernorm.weight", d
        yield pre + "self_attention.linear_proj.weight", h * heads // tp * d
        yield pre + "pre_mlp_layernorm.weight", h
        yield pre + "mlp.linear_fc1.weight", 2 * f // tp * h
        yield pre + "mlp.linear_fc2.weight", h * f // tp
    if pp_rank == pp - 1:
        yield "decoder.final_layernorm.weight", h
        if critic:
            yield "output_layer.weight", h  # the value head, replicated
            yield "output_layer.bias", 1
        elif not shape.tie_word_embeddings or pp > 1:
            yield "output_layer.weight", vocab // tp * h


@dataclass
class _Process:
    name: str
    gpu: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    regions: dict[str, list[str]] = field(default_factory=dict)  # region -> buffers paused with host backup
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)  # region -> buffers paused without backup


class RankLedger:
    """The GPU and host of one simulated rank: every process's buffers, and the peaks of each marked phase."""

    def __init__(self) -> None:
        self.procs: dict[str, _Process] = {}
        self.phase: str | None = None
        self.gpu_peaks: dict[str, int] = {}
        self.host_peaks: dict[str, int] = {}
        self.events: list[tuple[str, str, str, int]] = []  # (process, event, buffer, bytes)

    def proc(self, name: str) -> _Process:
        return self.procs.setdefault(name, _Process(name))

    @property
    def gpu(self) -> int:
        return sum(sum(p.gpu.values()) for p in self.procs.values())

    @property
    def host(self) -> int:
        return sum(sum(p.host.values()) for p in self.procs.values())

    def _observe(self) -> None:
        if self.phase is not None:
            self.gpu_peaks[self.phase] = max(self.gpu_peaks.get(self.phase, 0), self.gpu)
            self.host_peaks[self.phase] = max(self.host_peaks.get(self.phase, 0), self.host)

    def start(self, phase: str | None) -> None:
        self.phase = phase
        self._observe()

    def alloc(self, proc: str, buf: str, nbytes: int, where: str = "gpu") -> None:
        p = self.proc(proc)
        store = p.gpu if where == "gpu" else p.host
        if buf in store:
            raise ValueError(f"{proc}: {buf} allocated twice")
        store[buf] = nbytes
        self.events.append((proc, f"alloc:{where}", buf, nbytes))
        self._observe()

    def free(self, proc: str, buf: str, where: str = "gpu") -> None:
        p = self.proc(proc)
        store = p.gpu if where == "gpu" else p.host
        self.events.append((proc, f"free:{where}", buf, store.pop(buf)))

    def pause(self, proc: str, region: str, buffers: list[str], *, backup: bool) -> None:
        """Drop `buffers` from the GPU; with backup their bytes go to the host first (copy, then free)."""
        p = self.proc(proc)
        if backup:
            for b in buffers:
                self.alloc(proc, f"{region}_backup/{b}", p.gpu[b], "host")
            p.regions[region] = list(buffers)
        else:
            p.dropped[region] = {b: p.gpu[b] for b in buffers}
        for b in buffers:
            self.free(proc, b)

    def resume(self, proc: str, region: str) -> None:
        p = self.proc(proc)
        if region in p.regions:
            for b in p.regions.pop(region):
                self.alloc(proc, b, p.host[f"{region}_backup/{b}"])
                self.free(proc, f"{region}_backup/{b}", "host")
        else:
            for b, n in p.dropped.pop(region).items():
                self.alloc(proc, b, n)


def _p(cfg: MemoryConfig) -> int:
    return 2 if cfg.bf16 else 4


class _Trainer:
    """One trained model's buffers on one rank and the offload policy's sleep / wake as ledger events."""

    def __init__(self, cfg: MemoryConfig, role: str, shape: ModelShape, pp_rank: int, ledger: RankLedger) -> None:
        self.cfg, self.role, self.shape, self.pp_rank, self.ledger = cfg, role, shape, pp_rank, ledger
        self.numel = sum(n for _, n in megatron_param_shapes(shape, cfg.tp, cfg.pp, pp_rank, role == "critic"))
        d = cfg.dp * cfg.cp if cfg.distributed_optimizer else 1
        padded = -(-self.numel // d) * d  # the flat buffer is padded so that it splits evenly over DP
        self.shard = padded // d
        p = _p(cfg)
        self.buffers = {"params": p * self.numel, "grads": 4 * self.numel}
        self.optimizer = {"adam_m": 4 * self.shard, "adam_v": 4 * self.shard}
        if cfg.bf16:
            self.optimizer = {"master": 4 * self.shard, **self.optimizer}
        self.asleep = False
        self.has_pinned_copy = False

    def build(self) -> None:
        for b, n in {**self.buffers, **self.optimizer}.items():
            self.ledger.alloc(self.role, b, n)
        if self.role == "actor" and self.cfg.reference:
            self.ledger.alloc(self.role, "reference", _p(self.cfg) * self.numel, "host")

    def sleep(self) -> None:
        if self.cfg.policy == "none":
            return
        led, role = self.ledger, self.role
        if self.cfg.policy == "legacy":
            led.alloc(role, "weights_copy", self.buffers["params"], "host")
            led.pause(role, "train", [*self.buffers, *self.optimizer], backup=True)
        else:
            if not self.has_pinned_copy:
                led.alloc(role, "weights_pinned", self.buffers["params"], "host")
                self.has_pinned_copy = True
            led.pause(role, "params_grads", list(self.buffers), backup=False)
            led.pause(role, "optimizer", list(self.optimizer), backup=True)
        self.asleep = True

    def wake(self) -> None:
        if self.cfg.policy == "none":
            return
        led, role = self.ledger, self.role
        if self.cfg.policy == "legacy":
            led.resume(role, "train")
            led.free(role, "weights_copy", "host")
        else:
            led.resume(role, "optimizer")
            led.resume(role, "params_grads")  # params copied back from the pinned copy, grads zeroed
        self.asleep = False

    # ---- activations of one micro-batch -----------------------------------------------------------------
    def _layer_elems(self) -> dict[str, int]:
        """Per token, the elements one layer saves for backward (TP-sharded where megatron shards them)."""
        s, t = self.shape, self.cfg.tp
        h, f, d = s.hidden_size, s.ffn_hidden_size, s.kv_channels
        q, kv = s.num_attention_heads * d // t, s.num_query_groups * d // t
        return {"input": h, "norm1": h, "qkv": q + 2 * kv, "rotated_qk": q + kv, "attn": q, "residual": h,
                "norm2": h, "fc1": 2 * f // t, "swiglu": f // t}  # fmt: skip

    def _vocab(self) -> int:
        return -(-self.shape.vocab_size // self.cfg.tp)

    def forward_no_grad(self, tokens: int) -> None:
        """A no-grad pass: each layer's transients come and go; the actor's last stage ends in the logits."""
        led, role, p = self.ledger, self.role, _p(self.cfg)
        h, f = self.shape.hidden_size, self.shape.ffn_hidden_size // self.cfg.tp
        for i in range(self.shape.num_layers // self.cfg.pp):
            names = {f"l{i}/input": h, f"l{i}/norm": h, f"l{i}/fc1": 2 * f, f"l{i}/swiglu": f}
            for b, n in names.items():
                led.alloc(role, b, p * tokens * n)
            for b in names:
                led.free(role, b)
        if self.role == "actor" and self.pp_rank == self.cfg.pp - 1:
            v = self._vocab()
            led.alloc(role, "hidden", p * tokens * h)
            temps = {"logits": p * tokens * v, **{f"fp32_{k}": 4 * tokens * v for k in range(3)}}
            for b, n in temps.items():
                led.alloc(role, b, n)
            for b in (*temps, "hidden"):
                led.free(role, b)

    def train_micro_batch(self, tokens: int) -> None:
        """Forward with saved activations (pp − stage micro-batches in flight under 1F1B), loss, backward."""
        led, role, p = self.ledger, self.role, _p(self.cfg)
        lt = self._layer_elems()
        saved: list[str] = []
        in_flight = self.cfg.pp - self.pp_rank
        for mb in range(in_flight):
            for i in range(self.shape.num_layers // self.cfg.pp):
                for k, n in lt.items():
                    name = f"mb{mb}/l{i}/{k}"
                    led.alloc(role, name, p * tokens * n)
                    saved.append(name)
        temps: list[str] = []
        if self.role == "actor" and self.pp_rank == self.cfg.pp - 1:
            v = self._vocab()
            led.alloc(role, "logits", p * tokens * v)
            temps.append("logits")
            for k in range(6):
                led.alloc(role, f"loss_fp32_{k}", 4 * tokens * v)
                temps.append(f"loss_fp32_{k}")
        for b in temps:
            led.free(role, b)
        for b in reversed(saved):
            led.free(role, b)

    def optimizer_step(self) -> None:
        if self.cfg.adam_foreach:
            self.ledger.alloc(self.role, "adam_sqrt_v", 4 * self.shard)  # torch's foreach AdamW: √v of the group
            self.ledger.free(self.role, "adam_sqrt_v")


@dataclass
class AccountantResult:
    """Per pipeline stage: GPU and host peaks of each phase of the steady-state step, and overall."""

    gpu: dict[int, dict[str, int]]
    host: dict[int, dict[str, int]]
    numel: dict[int, dict[str, int]]

    def peak_gpu(self, pp_rank: int) -> int:
        return max(self.gpu[pp_rank].values())

    def peak_host(self, pp_rank: int) -> int:
        return max(self.host[pp_rank].values())


def _engine_weight_bytes(cfg: MemoryConfig) -> int:
    n = cfg.engine_params
    if n is None:
        n = sum(c for _, c in megatron_param_shapes(cfg.actor, 1, 1, 0, False))
    return 2 * n // cfg.engine_tp


def replay_rank(cfg: MemoryConfig, pp_rank: int) -> RankLedger:
    """Start-up and two colocated steps on one rank of stage `pp_rank`; phases of the second step are marked."""
    led = RankLedger()
    roles = [("critic", cfg.critic)] if cfg.critic is not None else []
    trainers = {r: _Trainer(cfg, r, s, pp_rank, led) for r, s in [*roles, ("actor", cfg.actor)]}
    engine_total = int(cfg.engine_fraction * cfg.gpu_capacity) if cfg.colocated else 0
    engine_weights = _engine_weight_bytes(cfg) if cfg.colocated else 0

    def engine_release() -> None:
        for b in list(led.proc("engine").gpu):
            led.free("engine", b)

    if cfg.colocated:
        led.alloc("engine", "weights", engine_weights)
        led.alloc("engine", "kv", max(0, engine_total - engine_weights))
        engine_release()  # the trainers build on the engines' GPUs next
    for tr in trainers.values():  # critic first, as the driver does
        tr.build()
        tr.sleep()

    def weight_sync(mark: bool) -> None:
        led.start("weight_sync" if mark else None)
        if cfg.colocated:
            led.alloc("engine", "weights", engine_weights)
        bucket = min(cfg.bucket_bytes, 2 * sum(c for _, c in megatron_param_shapes(cfg.actor, 1, 1, 0, False)))
        led.alloc("actor", "sync_bucket", bucket, "host")
        led.free("actor", "sync_bucket", "host")
        led.start(None)
        if cfg.colocated:
            led.alloc("engine", "kv", max(0, engine_total - engine_weights))

    weight_sync(False)
    for step in range(2):
        mark = step == 1
        led.start("rollout" if mark else None)
        if cfg.colocated:
            engine_release()
        led.start(None)
        if "critic" in trainers:
            c = trainers["critic"]
            c.wake()
            led.start("critic_values" if mark else None)
            c.forward_no_grad(cfg.train_tokens)
            led.start("critic_train" if mark else None)
            c.train_micro_batch(cfg.train_tokens)
            c.optimizer_step()
            led.start(None)
            c.sleep()
        a = trainers["actor"]
        a.wake()
        led.start("actor_log_probs" if mark else None)
        a.forward_no_grad(cfg.logprob_tokens)
        if cfg.reference:
            led.alloc("actor", "weights_swapped_out", _p(cfg) * a.numel, "host")
            a.forward_no_grad(cfg.logprob_tokens)
            led.free("actor", "weights_swapped_out", "host")
        led.start("actor_train" if mark else None)
        a.train_micro_batch(cfg.train_tokens)
        a.optimizer_step()
        led.start(None)
        a.sleep()
        weight_sync(mark)
    return led


def replay(cfg: MemoryConfig, *, every_rank: bool = True) -> AccountantResult:
    """Replay every rank of the world (each on its own simulated rank, megatron's layout); one result per stage,
    after checking that the ranks of a stage (TP / DP / CP peers) booked exactly the same. `every_rank=False`
    replays one rank per stage (the same numbers, for callers that replay many configurations)."""
    if every_rank:
        world = SimulatedWorld(cfg.tp * cfg.pp * cfg.dp * cfg.cp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp)
        per_rank = world.run(lambda ps: (ps.rank("pp"), replay_rank(cfg, ps.rank("pp"))))
    else:
        per_rank = [(s, replay_rank(cfg, s)) for s in range(cfg.pp)]
    gpu: dict[int, dict[str, int]] = {}
    host: dict[int, dict[str, int]] = {}
    for pp_rank, led in per_rank:
        if pp_rank in gpu and (gpu[pp_rank], host[pp_rank]) != (led.gpu_peaks, led.host_peaks):
            raise AssertionError(f"ranks of stage {pp_rank} disagree")
        gpu[pp_rank], host[pp_rank] = dict(led.gpu_peaks), dict(led.host_peaks)
    numel = {
        pp_rank: {
            r: sum(n for _, n in megatron_param_shapes(s, cfg.tp, cfg.pp, pp_rank, r == "critic"))
            for r, s in (("actor", cfg.actor), ("critic", cfg.critic))
            if s is not None
        }
        for pp_rank in range(cfg.pp)
    }
    return AccountantResult(gpu, host, numel)
