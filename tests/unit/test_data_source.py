"""Data source and dataset: epochs, shuffle determinism, resume, slices, parquet, chat template, errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from slime.arguments import default_args
from slime.rollout.data_source import RolloutDataSource, RolloutDataSourceWithBuffer, validate_prompt_data
from slime.rollout.dataset import Dataset, parse_data_path
from slime.utils.errors import SlimeArgError
from slime.utils.types import Sample, Status

pytestmark = pytest.mark.cpu


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def source_args(prompt_data: str | None, **kw: Any) -> argparse.Namespace:
    """The parser's defaults (input/metadata/tool keys 'input'/'metadata'/'tools'), labels and 2 samples per prompt."""
    return default_args(**{"prompt_data": prompt_data, "label_key": "label", "n_samples_per_prompt": 2, **kw})


@pytest.fixture
def data5(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "d.jsonl", [{"input": f"q{i}", "label": str(i), "metadata": {"k": i}} for i in range(5)]
    )


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def prompts(groups: list[list[Sample]]) -> list[str]:
    return [g[0].prompt for g in groups]


def test_groups_indices_and_epochs(data5: Path) -> None:
    ds = RolloutDataSource(source_args(str(data5)))
    assert len(ds) == ds.num_prompts == 5
    groups = ds.get_samples(3) + ds.get_samples(4)  # crosses into epoch 1
    assert prompts(groups) == ["q0", "q1", "q2", "q3", "q4", "q0", "q1"]
    assert ds.epoch_id == 1 and ds.offset == 2
    assert [g[0].group_index for g in groups] == list(range(7))
    assert [s.index for g in groups for s in g] == list(range(14))
    for g in groups:
        assert len(g) == 2 and g[0] is not g[1] and g[0].metadata is not g[1].metadata
        assert all(s.group_id is None and s.status == Status.PENDING for s in g)
        assert g[0].label == g[0].prompt[1:] and g[0].metadata == {"k": int(g[0].label)}


def test_shuffle_is_seeded_per_epoch(data5: Path) -> None:
    def order(seed: int) -> list[str]:
        ds = RolloutDataSource(source_args(str(data5), rollout_shuffle=True, rollout_seed=seed))
        return prompts(ds.get_samples(15))

    a, b = order(7), order(7)
    assert a == b
    epochs = [a[0:5], a[5:10], a[10:15]]
    assert all(sorted(e) == [f"q{i}" for i in range(5)] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled with seed + epoch
    assert order(7) != order(8)


def test_save_load_round_trip_resumes_identically(data5: Path, tmp_path: Path) -> None:
    args = source_args(str(data5), rollout_shuffle=True, n_samples_per_prompt=3)
    ref = RolloutDataSourceWithBuffer(args)
    ref.get_samples(4)
    buffered = ref.get_samples(2)
    buffered[0][1].response, buffered[0][1].tokens, buffered[0][1].status = "partial", [1, 2, 3], Status.ABORTED
    ref.add_samples(buffered)
    ref.save(3, str(tmp_path / "st"))
    assert not list((tmp_path / "st").glob("*.tmp*"))

    resumed = RolloutDataSourceWithBuffer(args)
    resumed.load(3, str(tmp_path / "st"))
    assert len(resumed.buffer) == 2
    for _ in range(3):
        a, b = ref.get_samples(3), resumed.get_samples(3)
        assert [[s.to_dict() for s in g] for g in a] == [[s.to_dict() for s in g] for g in b]
    # the first pulls drained the buffer (pop_first), keeping the partial sample intact
    fresh = RolloutDataSourceWithBuffer(args)
    fresh.load(3, str(tmp_path / "st"))
    first = fresh.get_samples(1)[0]
    assert first[1].response == "partial" and first[1].status == Status.ABORTED and first[1].tokens == [1, 2, 3]


def test_load_defaults_to_args_load_and_missing_state_is_fresh(data5: Path, tmp_path: Path) -> None:
    args = source_args(str(data5), save=str(tmp_path), load=str(tmp_path))
    ds = RolloutDataSource(args)
    ds.get_samples(2)
    ds.save(1)
    assert (tmp_path / "rollout" / "global_dataset_state_dict_1.json").exists()
    other = RolloutDataSource(args)
    other.load(1)
    assert other.offset == 2 and other.sample_index == 4
    fresh = RolloutDataSource(args)
    fresh.load(99)  # nothing saved there: start from the beginning
    assert fresh.offset == 0 and fresh.sample_index == 0


def test_buffer_first_and_custom_filter(data5: Path) -> None:
    ds = RolloutDataSourceWithBuffer(source_args(str(data5)))
    g = ds.get_samples(2)
    ds.add_samples(g)
    out = ds.get_samples(3)
    assert [x[0].index for x in out[:2]] == [0, 2] and out[2][0].prompt == "q2"
    assert ds.buffer == []
    with pytest.raises(ValueError, match="n_samples_per_prompt=2"):
        ds.add_samples([[Sample()]])
    with pytest.raises(RuntimeError, match="read-only"):
        RolloutDataSource(source_args(str(data5))).add_samples(g)

    newest = RolloutDataSourceWithBuffer(source_args(str(data5), buffer_filter_path=f"{__name__}.pop_last"))
    newest.add_samples(newest.get_samples(3))
    assert [x[0].group_index for x in newest.get_samples(2)] == [2, 1]


def pop_last(args, rollout_id, buffer, n):
    out = [buffer.pop() for _ in range(min(n, len(buffer)))]
    return out


def test_disabled_global_dataset_gives_empty_prompt_groups() -> None:
    ds = RolloutDataSourceWithBuffer(source_args(None, disable_rollout_global_dataset=True))
    assert len(ds) == 0
    groups = ds.get_samples(2)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]] and groups[0][0].prompt == ""
    assert validate_prompt_data(source_args(None, disable_rollout_global_dataset=True)) == 0


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("@[1:3]", ["q1", "q2"]), ("@[:2]", ["q0", "q1"]), ("@[3:]", ["q3", "q4"]), ("@[-2:]", ["q3", "q4"]), ("", None)],
)
def test_slices(data5: Path, spec: str, expected: list[str] | None) -> None:
    ds = Dataset(str(data5) + spec)
    assert [s.prompt for s in ds.samples] == (expected or [f"q{i}" for i in range(5)])
    assert parse_data_path("a@b.jsonl") == ("a@b.jsonl", None)


def test_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": f"p{i}", "answer": i, "metadata": json.dumps({"rm_type": "math"})} for i in range(4)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    args = source_args(f"{path}@[1:]", input_key="question", label_key="answer")
    assert validate_prompt_data(args) == 3
    s = RolloutDataSource(args).get_samples(1)[0][0]
    assert (s.prompt, s.label, s.metadata) == ("p1", 1, {"rm_type": "math"})


def test_chat_template_tools_and_length_filter(tmp_path: Path, tiny_ckpt: Path) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"input": "short", "tools": tools},
            {"input": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
            {"input": "long " * 300},
        ],
    )
    args = source_args(str(path), apply_chat_template=True, hf_checkpoint=str(tiny_ckpt), rollout_max_prompt_len=600)
    ds = RolloutDataSource(args)
    assert len(ds) == 2  # the long prompt is dropped
    assert ds.dataset.num_dropped_too_long == 1
    first, second = ds.dataset.samples
    assert "lookup" in first.prompt and "<tools>" in first.prompt and first.prompt.endswith("<|im_start|>assistant\n")
    assert first.metadata["tools"] == tools
    assert "be brief" in second.prompt and "<tools>" not in second.prompt

    kw = source_args(
        str(path) + "@[:1]",
        apply_chat_template=True,
        hf_checkpoint=str(tiny_ckpt),
        apply_chat_template_kwargs=json.dumps({"add_generation_prompt": False}),
    )
    with pytest.raises(TypeError):  # kwargs reach apply_chat_template (duplicate key proves it)
        RolloutDataSource(kw)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"input": "a"}\n{"input": oops}\n', r"^--prompt-data .*d\.jsonl:2: invalid JSON \("),
        ('{"input": "a"}\n\n{"question": "b"}\n', r"^--prompt-data .*d\.jsonl:3: no key 'input'"),
        ("[1, 2]\n", r"d\.jsonl:1: expected a JSON object"),
    ],
)
def test_file_errors_name_the_line(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(SlimeArgError, match=match) as e:
        validate_prompt_data(source_args(str(path)))
    assert "\n" not in str(e.value)


def test_missing_file_and_extension(tmp_path: Path) -> None:
    with pytest.raises(SlimeArgError, match=r"^--prompt-data: file not found: .*nope\.jsonl$"):
        validate_prompt_data(source_args(str(tmp_path / "nope.jsonl")))
    (tmp_path / "d.csv").write_text("input\nx\n")
    with pytest.raises(SlimeArgError, match=r"unsupported extension '\.csv'"):
        validate_prompt_data(source_args(str(tmp_path / "d.csv")))
    with pytest.raises(SlimeArgError, match="--eval-prompt-data aime: file not found"):
        validate_prompt_data(
            source_args(None, disable_rollout_global_dataset=True, eval_prompt_data=["aime", "x.jsonl"])
        )
    with pytest.raises(SlimeArgError, match="name path' pairs"):
        validate_prompt_data(source_args(None, disable_rollout_global_dataset=True, eval_prompt_data=["aime"]))


def test_driver_check_loads_a_tokenizer_only_for_a_length_limit(tmp_path: Path, tiny_ckpt: Path, monkeypatch) -> None:
    """The driver counts prompts without the chat template (no torch/transformers there) unless a length limit
    makes the count depend on tokens; a missing checkpoint for the template is still refused up front."""
    import slime.rollout.dataset as dataset

    path = write_jsonl(tmp_path / "c.jsonl", [{"input": "short"}, {"input": "long " * 300}])
    loaded = []
    real = dataset.load_tokenizer
    monkeypatch.setattr(dataset, "load_tokenizer", lambda ckpt: loaded.append(ckpt) or real(ckpt))
    chat = {"apply_chat_template": True, "hf_checkpoint": str(tiny_ckpt)}
    assert validate_prompt_data(source_args(str(path), **chat)) == 2
    assert loaded == []
    assert validate_prompt_data(source_args(str(path), **chat, rollout_max_prompt_len=600)) == 1
    assert loaded == [str(tiny_ckpt)]
    assert validate_prompt_data(source_args(str(path), **chat, eval_max_prompt_len=600)) == 2  # limits eval only
    with pytest.raises(SlimeArgError, match="need --hf-checkpoint"):
        validate_prompt_data(source_args(str(path), apply_chat_template=True, hf_checkpoint=None))
