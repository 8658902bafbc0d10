"""Prompt datasets: `--prompt-data` / `--eval-prompt-data` files (JSONL or parquet) turned into prompt Samples.

Every problem with the user's file is a one-line `SlimeArgError` naming the flag, the file and, for JSONL,
the line, because `validate_prompt_data` runs in the driver before Ray starts and the CLI prints it as is.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

from slime.utils.errors import SlimeArgError
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

_SLICE_RE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


def parse_data_path(spec: str) -> tuple[str, slice | None]:
    """Split slime's `path@[start:end]` syntax (Python slice semantics, either end optional)."""
    m = _SLICE_RE.match(spec)
    if m is None:
        return spec, None
    start = int(m["start"]) if m["start"] else None
    end = int(m["end"]) if m["end"] else None
    return m["path"], slice(start, end)


@functools.lru_cache(maxsize=4)
def load_tokenizer(hf_checkpoint: str) -> Any:
    """The HF tokenizer of `--hf-checkpoint` (cached: datasets, rollout and eval share one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_checkpoint, trust_remote_code=True)


def _iter_rows(path: str, flag: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (location, row) where location names the line (JSONL) or row (parquet) for error messages."""
    if not os.path.exists(path):
        raise SlimeArgError(f"{flag}: file not found: {path}")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SlimeArgError(
                        f"{flag} {path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})"
                    ) from None
                if not isinstance(row, dict):
                    raise SlimeArgError(f"{flag} {path}:{lineno}: expected a JSON object, got {type(row).__name__}")
                yield f"{path}:{lineno}", row
    elif ext == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise SlimeArgError(f"{flag} {path}: cannot read parquet ({type(e).__name__}: {e})") from None
        for i, row in enumerate(rows, start=1):
            yield f"{path} row {i}", row
    else:
        raise SlimeArgError(f"{flag} {path}: unsupported extension {ext or '(none)'!r}; expected .jsonl or .parquet")


def _maybe_json(value: Any, what: str, where: str, flag: str) -> Any:
    # parquet columns often hold nested data as JSON strings
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise SlimeArgError(f"{flag} {where}: {what} is a string but not valid JSON") from None
    return value


class Dataset:
    """Prompt Samples of one data file (no group/index yet; the data source assigns those)."""

    def __init__(
        self,
        path: str,
        *,
        tokenizer: Any = None,
        input_key: str = "input",
        label_key: str | None = None,
        metadata_key: str = "metadata",
        tool_key: str | None = "tools",
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: dict[str, Any] | None = None,
        max_prompt_len: int | None = None,
        flag: str = "--prompt-data",
    ) -> None:
        file_path, row_slice = parse_data_path(path)
        if apply_chat_template and tokenizer is None:
            raise SlimeArgError(f"{flag}: --apply-chat-template needs a tokenizer (set --hf-checkpoint)")
        rows = list(_iter_rows(file_path, flag))
        if row_slice is not None:
            rows = rows[row_slice]
        self.path = path
        self.samples: list[Sample] = []
        too_long = 0
        for where, row in rows:
            if input_key not in row:
                raise SlimeArgError(
                    f"{flag} {where}: no key {input_key!r} (set --input-key; keys present: {sorted(row)[:10]})"
                )
            prompt = row[input_key]
            tools = _maybe_json(row.get(tool_key), "tools", where, flag) if tool_key else None
            metadata = _maybe_json(row.get(metadata_key), "metadata", where, flag) if metadata_key else None
            metadata = dict(metadata or {})
            if tools is not None:
                metadata["tools"] = tools
            if apply_chat_template:
                messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                prompt = tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=True,
                    **(apply_chat_template_kwargs or {}),
                )
            if max_prompt_len is not None and tokenizer is not None:
                if _prompt_num_tokens(tokenizer, prompt, tools) > max_prompt_len:
                    too_long += 1
                    continue
            label = row.get(label_key) if label_key else None
            self.samples.append(Sample(prompt=prompt, label=label, metadata=metadata))
        self.num_dropped_too_long = too_long
        if too_long:
            logger.info(
                "%s %s: dropped %d of %d prompts longer than %d tokens",
                flag,
                path,
                too_long,
                len(rows),
                max_prompt_len,
            )

    def __len__(self) -> int:
        return len(self.samples)


def _prompt_num_tokens(tokenizer: Any, prompt: str | list[dict[str, Any]], tools: Any) -> int:
    if not isinstance(prompt, str):
        prompt = tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(prompt, add_special_tokens=False))


def _chat_template_kwargs(args: Any) -> dict[str, Any]:
    raw = args.apply_chat_template_kwargs
    if not raw:
        return {}
    if isinstance(raw, dict):
        return raw
    try:
        out = json.loads(raw)
    except json.JSONDecodeError as e:
        raise SlimeArgError(f"--apply-chat-template-kwargs: invalid JSON ({e.msg})") from None
    if not isinstance(out, dict):
        raise SlimeArgError("--apply-chat-template-kwargs must be a JSON object")
    return out


def _tokenizer_for(args: Any, needed: bool) -> Any:
    if not needed:
        return None
    if not args.hf_checkpoint:
        raise SlimeArgError("--apply-chat-template / --rollout-max-prompt-len need --hf-checkpoint (the tokenizer)")
    return load_tokenizer(args.hf_checkpoint)


def build_train_dataset(args: Any) -> Dataset:
    """The `--prompt-data` dataset as the flags describe it."""
    if not args.prompt_data:
        raise SlimeArgError("--prompt-data is required unless --disable-rollout-global-dataset is set")
    max_len = args.rollout_max_prompt_len
    chat = bool(args.apply_chat_template)
    return Dataset(
        args.prompt_data,
        tokenizer=_tokenizer_for(args, chat or max_len is not None),
        input_key=args.input_key,
        label_key=args.label_key,
        metadata_key=args.metadata_key,
        tool_key=args.tool_key,
        apply_chat_template=chat,
        apply_chat_template_kwargs=_chat_template_kwargs(args),
        max_prompt_len=max_len,
    )


def eval_dataset_specs(args: Any) -> list[tuple[str, str]]:
    """`--eval-prompt-data name path [name path ...]` as (name, path) pairs."""
    raw = args.eval_prompt_data or []
    if len(raw) % 2:
        raise SlimeArgError(f"--eval-prompt-data takes 'name path' pairs; got {len(raw)} value(s): {raw}")
    return [(raw[i], raw[i + 1]) for i in range(0, len(raw), 2)]


def build_eval_dataset(args: Any, name: str, path: str) -> Dataset:
    """One eval dataset; `--eval-*` keys and lengths default to their rollout counterparts."""

    def pick(eval_value: Any, train_value: Any) -> Any:
        return eval_value if eval_value is not None else train_value

    max_len = pick(args.eval_max_prompt_len, args.rollout_max_prompt_len)
    chat = bool(args.apply_chat_template)
    return Dataset(
        path,
        tokenizer=_tokenizer_for(args, chat or max_len is not None),
        input_key=pick(args.eval_input_key, args.input_key),
        label_key=pick(args.eval_label_key, args.label_key),
        metadata_key=args.metadata_key,
        tool_key=pick(args.eval_tool_key, args.tool_key),
        apply_chat_template=chat,
        apply_chat_template_kwargs=_chat_template_kwargs(args),
        max_prompt_len=max_len,
        flag=f"--eval-prompt-data {name}",
    )


def validate_prompt_data(args: Any) -> int:
    """Read every prompt file once in the driver (before `ray.init`) so a bad file fails fast with one line.

    Returns the number of training prompts (0 with `--disable-rollout-global-dataset`). The chat template is not
    applied here unless a length limit needs the token counts: loading a tokenizer imports torch and
    transformers (~4 CPU-s) in a process that needs neither, and the rollout side applies it anyway."""
    if args.apply_chat_template and not args.hf_checkpoint:
        _tokenizer_for(args, True)  # the one-line error, before anything starts
    if args.rollout_max_prompt_len is None and args.eval_max_prompt_len is None:
        args = argparse.Namespace(**{**vars(args), "apply_chat_template": False})
    for name, path in eval_dataset_specs(args):
        build_eval_dataset(args, name, path)
    if args.disable_rollout_global_dataset:
        return 0
    ds = build_train_dataset(args)
    if len(ds) == 0:
        raise SlimeArgError(
            f"--prompt-data {args.prompt_data}: no prompts left"
            + (f" ({ds.num_dropped_too_long} longer than --rollout-max-prompt-len)" if ds.num_dropped_too_long else "")
        )
    return len(ds)
