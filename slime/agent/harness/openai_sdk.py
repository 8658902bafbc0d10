"""`--agent-harness openai-sdk`: a minimal tool-using agent written against the real `openai` client.

Why a real client: it exercises the gateway exactly as an external agent would (HTTP, the SDK's own request
shapes and retries), while the episode still runs in-process so a rollout needs no extra services. Tools:
`calculator` (arithmetic on + - * / ** and parentheses) and `lookup` (a key in the sample's
`metadata["kv"]`, else in its metadata). The final answer is scored with the rollout's reward function
(`--custom-rm-path` / `--rm-type`), and the merged token segments become the trajectory's samples
(fan-out contract: one group id).
"""

from __future__ import annotations

import ast
import copy
import json
import logging
import operator
from typing import Any

from slime.agent.embedded import get_embedded_gateway
from slime.agent.trajectory import fan_out_sample_segments
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a helpful assistant. Use the tools when they help, then give the final answer."

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a value by key.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    },
]

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """Evaluate arithmetic without `eval`: the expression comes from the policy."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / ** are allowed")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def run_tool(name: str, arguments: str, metadata: dict[str, Any]) -> str:
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not valid JSON"
    if not isinstance(args, dict):
        return "error: arguments must be an object"
    if name == "calculator":
        return calculate(str(args.get("expression", "")))
    if name == "lookup":
        table = metadata.get("kv") if isinstance(metadata.get("kv"), dict) else metadata
        key = str(args.get("key", ""))
        return json.dumps(table[key]) if key in table else f"error: no key {key!r}"
    return f"error: unknown tool {name!r}"


def _initial_messages(sample: Sample) -> list[dict[str, Any]]:
    if isinstance(sample.prompt, list):
        msgs = copy.deepcopy(sample.prompt)
        return (
            msgs if msgs and msgs[0].get("role") == "system" else [{"role": "system", "content": SYSTEM_PROMPT}] + msgs
        )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": sample.prompt}]


async def generate(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample]:
    from openai import APIConnectionError, APIStatusError, AsyncOpenAI

    from slime.rollout.rm_hub import async_rm

    gw = await get_embedded_gateway(args)
    sess = await gw.open_session(
        sampling_defaults=sampling_params,
        max_context_tokens=args.rollout_max_context_len or 0,  # None: no cap
        metadata={"index": sample.index},
    )
    max_turns = args.agent_max_turns
    # the key goes in a header, not in the URL (`sess["base_url"]`): httpx logs every URL it calls
    client = AsyncOpenAI(base_url=f"{gw.public_url}/v1", api_key=sess["api_key"], max_retries=0, timeout=None)
    messages = _initial_messages(sample)
    final, truncated, num_tool_calls, failure = "", False, 0, None
    try:
        for _ in range(max_turns):
            resp = await client.chat.completions.create(model=gw.model_name, messages=messages, tools=TOOLS)
            choice = resp.choices[0]
            msg = choice.message
            messages.append(msg.model_dump(exclude_none=True))
            final = msg.content or ""
            truncated = choice.finish_reason == "length"
            if not msg.tool_calls:
                break
            for call in msg.tool_calls:
                num_tool_calls += 1
                result = run_tool(call.function.name, call.function.arguments, sample.metadata)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except (APIStatusError, APIConnectionError) as e:
        # e.g. the rollout aborted the engines: the episode ends here, what was sampled is discarded
        failure = f"{type(e).__name__}: {e}".replace(sess["api_key"], "***")
    finally:
        await client.close()
        segments = await gw.finish_session(sess["session_id"])

    if failure is not None or not segments:
        sample.status = Status.ABORTED
        sample.metadata["abort_reason"] = failure or "the agent produced no tokens"
        return [sample]
    scored = copy.copy(sample)
    scored.response = final
    reward = await async_rm(args, scored)
    out = fan_out_sample_segments(
        sample,
        segments,
        reward,
        mode=args.fan_out_reward,
        tokenizer=gw.tokenizer,
        metadata={"num_tool_calls": num_tool_calls, "final_answer": final},
    )
    for s in out:
        s.status = Status.TRUNCATED if truncated else Status.COMPLETED
    return out
