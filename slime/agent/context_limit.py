"""The served model's context length, and refusing a prompt that cannot fit in it before it is tokenized.

A session opened without `max_context_tokens` used to forward any prompt to the engine: a 1.85M-token prompt of
20k tool definitions hung a fake engine, and tokenizing a 50 MB prompt on the gateway took two minutes. Every
prompt is now held to the served model's context length, answered as SGLang answers it (400, "The input (N
tokens) is longer than the model's context length (M tokens).", python/sglang/srt/managers/tokenizer_manager.py
`_validate_one_request`), and a prompt whose bytes alone prove it too long is refused without tokenizing: no
token of the vocabulary covers more than `max_token_bytes` bytes of text, so a text of B bytes has at least
B / max_token_bytes tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from slime.agent.messages import BadRequest

logger = logging.getLogger(__name__)

# python/sglang/srt/utils/hf_transformers/common.py `CONTEXT_LENGTH_KEYS`, in SGLang's order of preference
CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)
# how much a normalizer may shrink UTF-8 text: NFC/NFKC composition at most 3x (Hangul jamo L+V+T -> a syllable)
_NORMALIZER_SHRINK = {"NFC": 3, "NFKC": 3}


def config_context_length(checkpoint: str | Path) -> int | None:
    """The context length SGLang derives from a checkpoint's `config.json` (`get_context_length`: the first of
    `CONTEXT_LENGTH_KEYS`, times a rope-scaling factor unless the scaling keeps the original length)."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config") or cfg
    scaling = cfg.get("rope_scaling") or {}
    factor = scaling.get("factor", 1) if isinstance(scaling, dict) else 1
    if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
        factor = 1
    for key in CONTEXT_LENGTH_KEYS:
        if cfg.get(key) is not None:
            return int(factor * cfg[key])
    return None


def max_token_bytes(tokenizer: Any) -> int | None:
    """An upper bound on the UTF-8 bytes of input one token can stand for, or None when the tokenizer's
    normalizer can shrink text without bound (then only an exact count decides)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    norm = getattr(backend, "normalizer", None) if backend is not None else None
    shrink = 1 if norm is None else _NORMALIZER_SHRINK.get(type(norm).__name__)
    if shrink is None:
        return None
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    # a byte-level piece writes each byte as one (possibly 2-byte) character: its length overestimates, as wanted
    return shrink * max(len(p.encode("utf-8", "replace")) for p in pieces if p is not None)


def too_long(n_tokens: int, context_length: int, *, at_least: bool = False) -> BadRequest:
    """SGLang's refusal of a prompt that does not fit (`at_least`: counted from its bytes, not tokenized)."""
    n = f"at least {n_tokens}" if at_least else str(n_tokens)
    return BadRequest(f"The input ({n} tokens) is longer than the model's context length ({context_length} tokens).")


class ContextLimit:
    """The served model's context length and the cheap byte bound that refuses a prompt without tokenizing."""

    def __init__(self, context_length: int, bytes_per_token: int | None) -> None:
        self.context_length = context_length
        self.bytes_per_token = bytes_per_token

    def check_text(self, text: str) -> bool:
        """Raise if `text` cannot fit by its bytes alone; True when it may not fit (an exact count must
        decide), False when it surely fits (fewer bytes than the context has tokens... for byte-level BPE)."""
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        if self.bytes_per_token and n_bytes > self.context_length * self.bytes_per_token:
            raise too_long(n_bytes // self.bytes_per_token, self.context_length, at_least=True)
        return n_bytes >= self.context_length

    def check_ids(self, n_tokens: int) -> None:
        if n_tokens >= self.context_length:  # SGLang refuses input_token_num >= context_len
            raise too_long(n_tokens, self.context_length)
