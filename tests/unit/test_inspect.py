"""`slime inspect`: a dumped rollout read as text and as a self-contained HTML page, masks shown on the tokens."""

from __future__ import annotations

import html.parser
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime.inspect_cli import load_dump, render_html, render_terminal
from slime.utils.errors import SlimeArgError
from slime.utils.types import Sample, Status

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def agent_samples(tok) -> list[Sample]:
    """One trajectory fanned out into two segments (one group id), the first with a masked tool output."""
    prompt = tok.encode("Fix the bug.", add_special_tokens=False)
    said, tool, more = (tok.encode(t, add_special_tokens=False) for t in ("I will run it.", "TOOL-OUT", "Done."))
    first = Sample(
        group_index=0, index=0, group_id=7, prompt="Fix the bug.", tokens=prompt + said + tool + more,
        response_length=len(said + tool + more), loss_mask=[1] * len(said) + [0] * len(tool) + [1] * len(more),
        reward=1.0, status=Status.COMPLETED, weight_versions=["3", "4"],
        rollout_log_probs=[-0.25] * len(said + tool + more), metadata={"segment_idx": 0, "num_segments": 2},
    )  # fmt: skip
    second = Sample(
        group_index=0, index=0, group_id=7, prompt="summary", tokens=prompt + more, response_length=len(more),
        reward=1.0, status=Status.TRUNCATED, weight_versions=["4"], metadata={"segment_idx": 1, "num_segments": 2},
    )  # fmt: skip
    return [first, second]


@pytest.fixture(scope="module")
def dump(tokenizer_dir: Path, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    samples = agent_samples(AutoTokenizer.from_pretrained(tokenizer_dir))
    path = tmp_path_factory.mktemp("dump") / "rollout_3.pt"
    data = {"rollout_id": 3, "hf_checkpoint": str(tokenizer_dir), "samples": [s.to_dict() for s in samples]}
    torch.save(data, path)
    return path


def test_terminal_view_shows_masks_segments_and_facts(dump: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    data, samples = load_dump(str(dump))
    text = render_terminal(data, samples, AutoTokenizer.from_pretrained(tokenizer_dir))
    assert "rollout 3: 2 samples, 1 groups" in text
    assert "segment: 1/2" in text and "segment: 2/2" in text and "group id: 7" in text
    assert "weight versions: 3,4" in text and "status: truncated" in text and "trained tokens" in text
    assert "⟨TOOL-OUT⟩" in text  # the tool output is shown as masked, as one run
    assert "I will run it" in text.replace("⟨", "").replace("⟩", "")


class _Collect(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):  # noqa: ANN001
        self.tags.append((tag, dict(attrs)))


def test_html_is_self_contained_and_marks_every_token(dump: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    data, samples = load_dump(str(dump))
    page = render_html(data, samples, AutoTokenizer.from_pretrained(tokenizer_dir))
    parser = _Collect()
    parser.feed(page)
    tags = [t for t, _ in parser.tags]
    assert "script" not in tags and "link" not in tags and "img" not in tags  # nothing fetched from elsewhere
    tokens = [a for t, a in parser.tags if t == "span" and a.get("class", "").startswith("t ")]
    n_response = sum(s.response_length for s in samples)
    assert len(tokens) == n_response + 2  # every response token, plus the two legend spans
    masked = [a for a in tokens[2:] if a["class"] == "t off"]
    assert len(masked) == sum(1 for m in samples[0].loss_mask if m == 0)
    assert "logprob -0.2500" in tokens[2]["title"]
    assert page.count("class='group'") == 1


def test_cli_writes_html_and_refuses_a_non_dump(dump: Path, tmp_path: Path) -> None:
    out = tmp_path / "page.html"
    run = subprocess.run(
        [sys.executable, "-m", "slime.cli", "inspect", str(dump), "--html", str(out)], capture_output=True, text=True,
        cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "group id: 7" in run.stdout and out.read_text().startswith("<!doctype html>")
    bad = tmp_path / "x.pt"
    torch.save([1, 2], bad)
    with pytest.raises(SlimeArgError, match="not a rollout dump"):
        load_dump(str(bad))
