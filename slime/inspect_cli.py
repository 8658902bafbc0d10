"""`slime inspect DUMP.pt [--html OUT]`: read a dumped rollout (`--save-debug-rollout-data`) as a person would.

Counts say a rollout happened; reading its samples says whether it is right: which tokens the loss trains on
(an agent's tool outputs must be masked), which segments form one group (sub-agents, context compaction),
which weights produced them. The terminal view is a table per sample; `--html` writes one self-contained
page (inline CSS, no scripts) where every token is a span: trained tokens in full colour, masked ones faded,
each with its id and log-prob on hover.
"""

from __future__ import annotations

import argparse
import html
import io
import itertools
import os
import sys
from collections.abc import Sequence
from typing import Any

from slime.utils.errors import SlimeArgError
from slime.utils.types import Sample


def load_dump(path: str) -> tuple[dict[str, Any], list[Sample]]:
    import torch

    if not os.path.isfile(path):
        raise SlimeArgError(f"inspect: no dump at {path}")
    try:
        data = torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise SlimeArgError(f"inspect: {path} is not a rollout dump ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict) or "samples" not in data:
        raise SlimeArgError(f"inspect: {path} is not a rollout dump (no 'samples')")
    return data, [Sample.from_dict(d) for d in data["samples"]]


def _tokenizer(path: str | None) -> Any:
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def prompt_text(sample: Sample) -> str:
    if isinstance(sample.prompt, str):
        return sample.prompt
    return "\n".join(f"[{m.get('role')}] {m.get('content')}" for m in sample.prompt if isinstance(m, dict))


def response_tokens(sample: Sample, tokenizer: Any) -> list[dict[str, Any]]:
    """Each response token: id, text (when a tokenizer is at hand), whether the loss trains on it, log-prob."""
    ids = sample.tokens[len(sample.tokens) - sample.response_length :] if sample.response_length else []
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * len(ids)
    lps = sample.rollout_log_probs or []
    out = []
    for i, tok in enumerate(ids):
        text = tokenizer.decode([tok]) if tokenizer is not None else f"<{tok}>"
        out.append(
            {"id": tok, "text": text, "trained": bool(mask[i]) if i < len(mask) else True,
             "logprob": lps[i] if i < len(lps) else None}
        )  # fmt: skip
    return out


def sample_facts(sample: Sample) -> dict[str, Any]:
    meta = sample.metadata or {}
    segment = f"{meta['segment_idx'] + 1}/{meta['num_segments']}" if "segment_idx" in meta else "-"
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    return {
        "index": sample.index,
        "prompt group": sample.group_index,
        "group id": sample.group_id,
        "segment": segment,
        "status": sample.status.value,
        "reward": sample.reward,
        "response tokens": sample.response_length,
        "trained tokens": int(sum(mask)),
        "weight versions": ",".join(dict.fromkeys(sample.weight_versions)) or "-",
        "removed": sample.remove_sample,
    }


def render_terminal(
    data: dict[str, Any], samples: Sequence[Sample], tokenizer: Any, width: int = 140, color: bool = False
) -> str:
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    console = Console(file=io.StringIO(), width=width, record=True, force_terminal=color)
    console.print(
        f"rollout {data.get('rollout_id')}: {len(samples)} samples, {len({s.group_id for s in samples})} groups"
    )
    for s in samples:
        facts = list(sample_facts(s).items())
        table = Table.grid(padding=(0, 2))
        for row in (facts[:5], facts[5:]):
            table.add_row(*[Text(f"{k}: {v}", style="bold" if k in ("reward", "status") else "") for k, v in row])
        body = Text()
        body.append("prompt: ", style="bold")
        body.append(prompt_text(s)[-600:] + "\n")
        body.append("response: ", style="bold")
        for trained, run in itertools.groupby(response_tokens(s, tokenizer), key=lambda t: t["trained"]):
            text = "".join(t["text"] for t in run)  # a masked run also in ⟨⟩, so plain text shows it too
            body.append(text if trained else f"⟨{text}⟩", style="green" if trained else "dim")
        console.print(table)
        console.print(Panel(body))
    console.print("response tokens: green = trained on, ⟨dim⟩ = masked from the loss")
    return console.export_text(styles=color)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; background: #fafafa; color: #222; }
.sample { background: white; border: 1px solid #ddd; border-radius: 6px; padding: 0.8em 1em; margin: 1em 0; }
.facts { font-size: 0.85em; color: #555; margin-bottom: 0.5em; }
.facts span { margin-right: 1.2em; }
.prompt { white-space: pre-wrap; color: #444; border-left: 3px solid #bbb; padding-left: 0.6em; }
.response { white-space: pre-wrap; margin-top: 0.5em; font-family: ui-monospace, monospace; }
.t { border-radius: 2px; }
.t.on { background: #d9f2d9; }
.t.off { background: #eee; color: #999; text-decoration: line-through; }
.group { border-top: 3px solid #88a; margin-top: 2em; padding-top: 0.3em; color: #446; }
"""


def render_html(data: dict[str, Any], samples: Sequence[Sample], tokenizer: Any) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>rollout {html.escape(str(data.get('rollout_id')))}</title><style>{_CSS}</style></head><body>",
        f"<h1>Rollout {html.escape(str(data.get('rollout_id')))}</h1>",
        f"<p>{len(samples)} samples in {len({s.group_id for s in samples})} groups. Response tokens: "
        "<span class='t on'>trained on</span> <span class='t off'>masked from the loss</span>; "
        "hover a token for its id and log-prob.</p>",
    ]
    last_group = object()
    for s in samples:
        if s.group_id != last_group:
            parts.append(f"<div class='group'>group {html.escape(str(s.group_id))}</div>")
            last_group = s.group_id
        facts = "".join(
            f"<span><b>{html.escape(k)}</b> {html.escape(str(v))}</span>" for k, v in sample_facts(s).items()
        )
        toks = []
        for t in response_tokens(s, tokenizer):
            lp = "-" if t["logprob"] is None else f"{t['logprob']:.4f}"
            cls = "on" if t["trained"] else "off"
            toks.append(f"<span class='t {cls}' title='id {t['id']}, logprob {lp}'>{html.escape(t['text'])}</span>")
        parts.append(
            f"<div class='sample'><div class='facts'>{facts}</div>"
            f"<div class='prompt'>{html.escape(prompt_text(s))}</div><div class='response'>{''.join(toks)}</div></div>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slime inspect", description="Show a dumped rollout's samples.")
    p.add_argument("dump", help="a file written by --save-debug-rollout-data")
    p.add_argument("--html", default=None, help="also write a self-contained HTML page here")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir to show token text (default: the run's)")
    p.add_argument("--limit", type=int, default=None, help="show the first N samples")
    a = p.parse_args(argv)
    data, samples = load_dump(a.dump)
    samples = samples[: a.limit] if a.limit else samples
    tok_dir = a.tokenizer or data.get("hf_checkpoint")
    tokenizer = _tokenizer(tok_dir if tok_dir and os.path.isdir(tok_dir) else None)
    sys.stdout.write(render_terminal(data, samples, tokenizer, color=sys.stdout.isatty()))
    if a.html:
        os.makedirs(os.path.dirname(os.path.abspath(a.html)), exist_ok=True)
        with open(a.html, "w", encoding="utf-8") as f:
            f.write(render_html(data, samples, tokenizer))
        sys.stdout.write(f"wrote {a.html}\n")
    return 0
