"""Prompt token ids for one request of a conversation chain: new, append, or wipe.

* **append**: the request repeats the chain's previous request (by message hash) and then the assistant
  message this gateway answered. The prompt is then the previous prompt ids + the exact sampled ids + the
  template's rendering of what follows, so the model sees its own tokens and merging never drifts ("token in,
  token out"). If the client changed that assistant message, the history is re-rendered after the previous
  prompt and `merge_turns` masks whatever no longer matches.
* **wipe**: anything else (history rewritten, e.g. compaction, or a retried request) freezes the chain's turns
  as their own segment and starts the chain again.

Pure apart from the tokenizer: the gateway calls `PromptBuilder.plan` under the session lock, in a thread (the
tokenizer releases the GIL while it encodes).
"""

from __future__ import annotations

from typing import Any

from slime.agent.api import ApiRequest
from slime.agent.parsing import ParsedOutput
from slime.agent.session import ChainTurn


def canonical_assistant(msg: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for a client's assistant message to count as the one we answered. Reasoning is
    left out: most clients do not send it back. Lists, not tuples, so it survives a JSON round trip."""
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in msg.get("tool_calls") or []]
    return {"content": (msg.get("content") or "").strip(), "tool_calls": calls}


def parsed_to_message(parsed: ParsedOutput) -> dict[str, Any]:
    """Our answer as the template message a client would send back, to compare the two canonically."""
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.text}
    if parsed.tool_calls:
        msg["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls
        ]
    return msg


class PromptBuilder:
    """Renders template messages to prompt ids against a conversation chain (pure apart from the tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.eos_text = tokenizer.eos_token
        self.eos_id = tokenizer.eos_token_id

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=gen)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def plan(self, last: ChainTurn | None, req: ApiRequest) -> tuple[str, list[int]]:
        """Prompt ids for a request (hashed and rendered already: `slime.agent.requests.measure`) continuing
        the chain whose newest turn is `last`. Returns (action, prompt_ids); action is new | append |
        append_rerendered | wipe (the caller freezes the chain on wipe)."""
        hashes, full = req.hashes, req.text
        if last is not None:
            k = len(last.hashes)
            if req.tools_hash == last.tools_hash and len(hashes) > k and hashes[:k] == last.hashes:
                ids = self._reuse_tokens(last, req.messages, req.tools, full, k)
                if ids is not None:
                    return "append", ids
                if full.startswith(last.prompt_text):
                    return "append_rerendered", last.record.prompt_ids + self.encode(full[len(last.prompt_text) :])
        ids = req.ids if req.ids is not None else self.encode(full)
        return ("new" if last is None else "wipe"), ids

    def _reuse_tokens(
        self, last: ChainTurn, messages: list[dict[str, Any]], tools: list[dict[str, Any]], full: str, k: int
    ) -> list[int] | None:
        nxt = messages[k]
        if len(messages) <= k + 1 or nxt["role"] != "assistant":
            return None
        if canonical_assistant(nxt) != last.response:
            return None
        upto = self.render(messages[: k + 1], tools, gen=False)
        end = upto.rfind(self.eos_text) if self.eos_text else -1
        if not full.startswith(upto) or end < 0:
            return None
        suffix = upto[end + len(self.eos_text) :] + full[len(upto) :]
        out = last.record.output_ids
        if not out or out[-1] != self.eos_id:  # cut by length: the template closes the turn itself
            suffix = self.eos_text + suffix
        return last.record.prompt_ids + list(out) + self.encode(suffix)
