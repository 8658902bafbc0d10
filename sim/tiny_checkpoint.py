"""Build a tiny Qwen2-architecture checkpoint (tokenizer + random weights) locally, with no downloads.

Why: no model weights can be downloaded on the project machines, yet slime's loading code must be the
same for tiny and real checkpoints. So the quick start, the fake SGLang server and the CPU training tests
all load an ordinary HF directory (`config.json`, `model.safetensors`, `tokenizer.json`,
`generation_config.json`, a Qwen2-style chat template with tool support) produced here.

The tokenizer is byte-level BPE (like Qwen2's), so any text round-trips; its vocabulary stays <= 512 so a
CPU step is cheap. `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are special (skipped by
`skip_special_tokens`); the tool / think markers are added tokens that are NOT special, as in Qwen2.5/Qwen3,
so they survive decoding and parsers can find them.

CLI: ``python -m sim.tiny_checkpoint OUT_DIR [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from slime.utils.atomic import replace_dir

logger = logging.getLogger(__name__)

# Bump when the produced files change, so stale stamps force a rebuild.
_FORMAT_VERSION = 1
STAMP_NAME = "tiny_checkpoint.json"
MAX_VOCAB = 512

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]

_CORPUS = [
    "0123456789 10 20 42 100 256 1000 3.14 -7 1+1=2 2*3=6 12/4=3 7-5=2",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \n\t",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"type": "function", "function": {"name": "search", "description": "Search the web", '
    '"parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}',
    "The quick brown fox jumps over the lazy dog. What is the answer? The answer is 42.",
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by",
    "word but not what all were we when your can said there use an each which she do how their if will up",
    "other about out many then them these so some her would make like him into time has look two more",
    "user assistant system tool function name arguments content role result error true false null",
    "Let me think step by step. First, compute the sum. Then check the result. Therefore the final answer is",
    "def main(): return 0\nimport os\nprint('hello world')\nfor i in range(10): x += i",
    "You are a helpful assistant. Please answer the question. Question: Answer: Solution: Hint:",
]

# transformers/models/qwen2/tokenization_qwen2.py: PRETOKENIZE_REGEX
_QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Qwen2.5-style chat template with tools, tool calls, tool responses and optional reasoning in <think>.
# Written for this project; layout follows the Qwen2.5 / Qwen3 conventions so agent parsers see real shapes.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{%- if loop.first and message.content %}{{- '\\n' }}{%- elif not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _build_tokenizer(vocab_size: int, extra_corpus: list[str] | None):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    # Same normalizer / pre-tokenizer as Qwen2's: transformers 5 rebuilds `Qwen2Tokenizer` with exactly
    # these from vocab + merges, so raw `tokenizers` and `AutoTokenizer` must agree token for token.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKER_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) + list(extra_corpus or []), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
        extra_special_tokens=["<|im_start|>"],
    )
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _params(**kw: Any) -> dict[str, Any]:
    return {"format_version": _FORMAT_VERSION, **kw}


def _is_complete(out: Path, params: dict[str, Any]) -> bool:
    stamp = out / STAMP_NAME
    needed = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    if not stamp.is_file() or not all((out / n).is_file() for n in needed):
        return False
    try:
        return json.loads(stamp.read_text()) == params
    except (OSError, json.JSONDecodeError):
        return False


def build_tiny_checkpoint(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    extra_corpus: list[str] | None = None,
    max_position_embeddings: int = 4096,
) -> Path:
    """Build (or reuse) the tiny checkpoint in `out_dir` and return its path. `max_position_embeddings` is the
    context length SGLang (and the fake, and the agent gateway) serve it with: agent CLIs need more than the
    default (Claude Code's system prompt alone is ~8k tokens of this tokenizer, Codex's ~20k).

    Idempotent so concurrent test workers and repeated quick starts share one build: a stamp file records
    the parameters, and files are built in a sibling temp dir and moved in with the stamp written last.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir).resolve()
    params = _params(
        seed=seed,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        extra_corpus=list(extra_corpus or []),
    )
    if max_position_embeddings != 4096:  # stamps of default builds stay as they were
        params["max_position_embeddings"] = max_position_embeddings
    if _is_complete(out, params):
        logger.info("tiny checkpoint already present at %s", out)
        return out

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = _build_tokenizer(MAX_VOCAB, extra_corpus)
        vocab = len(tokenizer)
        assert vocab <= MAX_VOCAB, vocab
        endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        config = Qwen2Config(
            vocab_size=vocab,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=endoftext,
            eos_token_id=im_end,
            pad_token_id=endoftext,
            use_sliding_window=False,
            dtype="float32",
        )
        # Seed right before construction: init order is fixed for a given config, so weights are a
        # pure function of (seed, shape parameters).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(config).to(torch.float32)
        model.generation_config = GenerationConfig(
            bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / STAMP_NAME).write_text(json.dumps(params, indent=1, sort_keys=True))

        replace_dir(tmp, out)
        logger.info("built tiny checkpoint (vocab=%d) at %s", vocab, out)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_random_qwen2(out: Path, num_layers: int, *, vocab_size: int = 96, hidden_size: int = 64,
                       intermediate_size: int = 96, tie_word_embeddings: bool = True) -> None:  # fmt: skip
    """Weights only (no tokenizer), fp32, seed 0, larger than HF's init so logits and gradients are far from
    uniform: what the layout-equivalence tests compare parallel layouts on."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(out)


def build_random_moe(out: Path, model_type: str = "qwen3_moe", *, num_layers: int = 2, num_experts: int = 4,
                     top_k: int = 2, norm_topk_prob: bool = True, vocab_size: int = 96, hidden_size: int = 64,
                     moe_intermediate_size: int = 32, shared_expert_intermediate_size: int = 48,
                     tie_word_embeddings: bool = False, seed: int = 0,
                     mlp_only_layers: tuple[int, ...] = ()) -> None:  # fmt: skip
    """A random Qwen3-MoE or Qwen2-MoE (shared expert + gate) checkpoint, weights only, fp32: what the MoE tests
    compare megatron's MoE layers against; `mlp_only_layers` makes those layers dense (HF's plain MLP). Weights as `build_random_qwen2` (larger than HF's init), router
    included, so routing is decided by clear margins and logits are far from uniform."""
    import torch
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=moe_intermediate_size, num_experts=num_experts, num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=tie_word_embeddings, decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers),
    )  # fmt: skip
    if model_type == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(head_dim=hidden_size // 4, **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif model_type == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(shared_expert_intermediate_size=shared_expert_intermediate_size, **common)
        cls = transformers.Qwen2MoeForCausalLM
    else:
        raise ValueError(f"model_type {model_type!r}: qwen3_moe or qwen2_moe")
    torch.manual_seed(seed)
    model = cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build a tiny random Qwen2 checkpoint + tokenizer (no downloads).")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--untie-word-embeddings", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    path = build_tiny_checkpoint(
        a.out_dir,
        seed=a.seed,
        hidden_size=a.hidden_size,
        num_layers=a.num_layers,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        intermediate_size=a.intermediate_size,
        tie_word_embeddings=not a.untie_word_embeddings,
    )
    print(path)


if __name__ == "__main__":
    main()
