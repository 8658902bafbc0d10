"""Colocated weight sync through `/update_weights_from_tensor` into a real `hf` fake engine.

After the push, the engine's returned log-probs must equal an independent HF forward of the *pushed* weights
(not the checkpoint's), the weight version must change, and the request log must show pause → flush → load
→ continue in that order.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from sim.fake_sglang.testing import launch_fake_sglang
from sim.rank_spawn import spawn_ranks
from sim.tiny_checkpoint import build_tiny_checkpoint
from slime.backends.megatron.weight_buckets import buckets_by_dtype, flatten
from slime.backends.megatron.weight_sync import TensorWeightSync

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ws") / "model")


def test_buckets_split_by_dtype_and_size_and_flatten_back():
    tensors = [("a", torch.ones(10)), ("b", torch.ones(10, dtype=torch.float64)), ("c", torch.ones(30))]
    buckets = list(buckets_by_dtype(tensors, bucket_bytes=100))
    assert sorted([n for n, _ in b] for b in buckets) == [["a"], ["b"], ["c"]]  # a (40 B) + c (120 B) > 100 B
    for bucket in buckets:
        flat, metadata = flatten(bucket)
        assert [m.name for m in metadata] == [n for n, _ in bucket]
        for m in metadata:
            t = flat[m.start_idx : m.end_idx].reshape(m.shape)
            assert torch.equal(t, dict(tensors)[m.name].to(m.dtype))


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_sync_changes_engine_weights_exactly(ckpt, tmp_path, version):
    """Into a server speaking either protocol: with update sessions (0.5.21+) and without (0.5.14-0.5.20)."""
    log = tmp_path / "requests.jsonl"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    named = [(n, p.detach().clone()) for n, p in model.state_dict().items()]
    prompt = [5, 17, 42, 99, 7]
    args = ["--engine", "hf", "--model-path", str(ckpt), "--request-log", str(log), "--sglang-version", version]
    with launch_fake_sglang(args) as srv:
        before = httpx.get(f"{srv.url}/model_info").json()
        sync = TensorWeightSync([srv.url], bucket_bytes=64 * 1024)  # one sender: a plain URL
        try:
            stats = sync.sync(named, weight_version=7)
        finally:
            sync.close()
        assert stats["weight_sync/buckets"] > 1
        after = httpx.get(f"{srv.url}/model_info").json()
        assert after != before and "7" in json.dumps(after)
        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 6, "sampling_seed": 3, "ignore_eos": True},
            "return_logprob": True,
        }
        out = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()
    assert out["meta_info"]["weight_version"] == "7"
    ids = out["output_ids"]
    engine_lp = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].double()
    ref = torch.log_softmax(logits / 0.7, dim=-1)[len(prompt) - 1 : -1].gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(engine_lp, ref, atol=1e-5)
    endpoints = [json.loads(line).get("endpoint") for line in log.read_text().splitlines()]
    seq = [e for e in endpoints if e in ("/pause_generation", "/flush_cache", "/update_weights_from_tensor",
                                         "/continue_generation")]  # fmt: skip
    first_load, last_load = (
        seq.index("/update_weights_from_tensor"),
        len(seq) - 1 - seq[::-1].index("/update_weights_from_tensor"),
    )
    assert seq[:2] == ["/pause_generation", "/flush_cache"] and first_load == 2
    assert seq[last_load + 1 :] == ["/continue_generation"]  # flushed once, while paused, before the loads


def test_live_weights_are_read_in_place_and_land_exactly(ckpt):
    """A `LiveWeights` stream whose storages the engine can read where they lie (here: one shared-memory buffer
    holding every tensor, gaps between them, as a trainer's DDP buffer holds its params) is sent without packing
    those tensors; the strided ones (each q_proj a column block of a wider tensor, as q/k/v of a fused QKV are)
    are packed. The engine ends with exactly the sent values."""
    from slime.backends.megatron.weight_buckets import LiveWeights
    from slime.backends.megatron.weight_hash import check_engines, tensor_checksum

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tied = model.config.tie_word_embeddings  # then a trainer sends no lm_head (the engine ties it itself)
    named = [(n, p.detach()) for n, p in model.state_dict().items() if not (tied and n == "lm_head.weight")]
    torch.manual_seed(1)
    total = sum(t.numel() + 3 for _, t in named)
    buffer = torch.randn(total).share_memory_()
    items, cursor = LiveWeights(hand_over=True), 0
    for name, t in named:
        if name.endswith("q_proj.weight"):  # strided: the left half of a [rows, 2 * cols] tensor
            wide = torch.randn(t.shape[0], 2 * t.shape[1])
            items.append((name, wide[:, : t.shape[1]], t.shape, t.dtype))
        else:
            cursor += 3  # a gap, as padding between params in a DDP buffer
            items.append((name, buffer[cursor : cursor + t.numel()].view(t.shape), t.shape, t.dtype))
            cursor += t.numel()
    with launch_fake_sglang(["--engine", "hf", "--model-path", str(ckpt)]) as srv:
        sync = TensorWeightSync([srv.url], bucket_bytes=64 * 1024)
        try:
            stats = sync.sync(items, weight_version=3)
            want = {name: tensor_checksum(src.reshape(shape)) for name, src, shape, _ in items}
            check_engines([srv.url], want)  # raises WeightMismatch naming the tensors that differ
            for _, src, _, _ in items:  # an optimizer step in place; the next sync reuses this one's split
                src.mul_(-0.5)
            again = sync.sync(items, weight_version=4)
            new = {name: tensor_checksum(src.reshape(shape)) for name, src, shape, _ in items}
            assert new != want
            check_engines([srv.url], new)
            want = new
            packed_only = sync.sync(LiveWeights(items), weight_version=5)  # not handed over: every tensor packed
        finally:
            sync.close()
        check_engines([srv.url], want)
    strided = [item for item in items if not item[1].is_contiguous()]
    assert stats["weight_sync/bytes"] == sum(t.numel() * 4 for _, t in named)
    # one in-place bucket (the shared buffer) plus the q_proj tensors packed in 64 KiB buckets
    assert (
        stats["weight_sync/buckets"]
        == again["weight_sync/buckets"]
        == 1 + len(list(buckets_by_dtype(strided, 64 * 1024)))
    )
    assert packed_only["weight_sync/buckets"] == len(list(buckets_by_dtype(items, 64 * 1024)))


def _sources_worker(rank: int, ckpt: str, out: str, port: int) -> None:
    from slime.arguments import parse_args
    from slime.backends.megatron.offload import TrainOffloader
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.backends.megatron.weight_buckets import new_buffer

    args = parse_args([
        "--hf-checkpoint", ckpt, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--colocate", "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply",
    ])  # fmt: skip
    off = TrainOffloader(args.offload_train)
    trainer = MegatronTrainer(args, 0, 1, "127.0.0.1", port, offloader=off)
    off.attach(trainer.model, trainer.optimizer)

    def flat_bytes(items) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for bucket in buckets_by_dtype(items, bucket_bytes=1 << 16):
            flat, meta = flatten(bucket, new_buffer(bucket))
            out.update({m.name: flat[m.start_idx : m.end_idx].reshape(m.shape).clone() for m in meta})
        return out

    res = {}
    sources = trainer.weights_for_sync()
    res["shapes_differ"] = sum(1 for _, src, shape, _ in sources if src.shape != shape)  # q/k/v: strided views
    res["equal_export"] = _same(flat_bytes(sources), {n: t.clone() for n, t in trainer.export_hf()})
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.5)  # a train step changes the weights in place: the kept views must see it
    off.sleep(keep_weights=True)
    res["same_list"] = trainer.weights_for_sync() is sources
    res["hand_over"] = sources.hand_over  # --colocate offloads: the params are released after every sync
    res["equal_after_change"] = _same(flat_bytes(trainer.weights_for_sync()), dict(trainer.export_hf()))
    off.sleep()  # params released: the sync reads the host copy, through the converting export
    res["asleep_is_export"] = trainer.weights_for_sync() is not sources
    off.wake_up()  # params re-grown in place: the kept views are valid again
    res["equal_after_wake"] = _same(flat_bytes(trainer.weights_for_sync()), dict(trainer.export_hf()))
    with open(out, "w") as f:
        json.dump(res, f)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_kept_sync_views_send_exactly_what_the_export_sends(ckpt, tmp_path):
    """`MegatronTrainer.weights_for_sync`: the views kept from the first sync flatten to the same bytes as the
    converting export, before and after the weights change in place and after a sleep/wake cycle re-grows the
    parameters' storages; while asleep the sync goes through the export (the host copy)."""
    from slime.utils.http_utils import find_free_port

    out = tmp_path / "res.json"
    spawn_ranks(_sources_worker, args=(str(ckpt), str(out), find_free_port()), nprocs=1)
    r = json.loads(out.read_text())
    assert r["shapes_differ"] > 0, r
    assert r["equal_export"] and r["same_list"] and r["equal_after_change"] and r["asleep_is_export"], r
    assert r["equal_after_wake"] and r["hand_over"], r


def test_a_refused_last_post_fails_the_sync_behind_a_closed_session(ckpt):
    """The session's closing calls go out behind the last post (start_end_weight_sync): when that post is refused
    the sync still fails, and the engine is left resumed with no session open, ready for the next sync."""
    from slime.backends.sglang.client import SGLangClient, begin_weight_sync, end_weight_sync

    with launch_fake_sglang(["--engine", "hf", "--model-path", str(ckpt)]) as srv:
        sync = TensorWeightSync([srv.url], bucket_bytes=1 << 20)
        try:
            with pytest.raises(Exception, match="unknown parameter names"):
                sync.sync([("model.nope.weight", torch.zeros(64))], weight_version=1)
        finally:
            sync.close()
        with SGLangClient(srv.url) as c:
            assert c.server_info()["internal_states"][0]["paused"] is False
            begin_weight_sync([c])  # refused if the failed sync had left its session open
            end_weight_sync([c])


def test_a_failed_post_stops_the_packer_thread(ckpt):
    """An engine that refuses a bucket fails the sync at once, and the packer thread (still holding packed buckets
    to hand over) is stopped, not left blocked behind; the next bucket's answer, still due when the first was
    refused (two posts in flight), is not read by the client's next call."""
    import threading

    from slime.backends.sglang.client import end_weight_sync

    named = [(f"model.layers.{i}.nope.weight", torch.zeros(64)) for i in range(20)]  # one bucket each
    with launch_fake_sglang(["--engine", "hf", "--model-path", str(ckpt)]) as srv:
        sync = TensorWeightSync([srv.url], bucket_bytes=256)
        try:
            with pytest.raises(Exception, match="unknown parameter names"):
                sync.sync(named, weight_version=1)
            end_weight_sync(list(sync.clients.values()))  # answered for itself, not with the refused post's answer
        finally:
            sync.close()
    assert not [t for t in threading.enumerate() if t.name == "weight-sync-pack"]
