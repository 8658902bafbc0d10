"""SFT "rollout": the response is the dataset's label, not a generation (`--loss-type sft_loss` warm-ups).

It runs through the same data source, train-data conversion and schedule as RL, so an SFT warm-up and the RL
run that follows it share every code path except sampling. The label is followed by the tokenizer's EOS so
the model learns to stop.
"""

from __future__ import annotations

import logging
from typing import Any

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.dataset import load_tokenizer
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


def _prompt_text(tokenizer: Any, sample: Sample) -> str:
    if isinstance(sample.prompt, str):
        return sample.prompt
    return tokenizer.apply_chat_template(
        sample.prompt, tools=sample.metadata.get("tools"), tokenize=False, add_generation_prompt=True
    )


def build_sft_sample(tokenizer: Any, sample: Sample) -> Sample:
    if sample.label is None:
        raise ValueError(f"sample {sample.index} has no label: SFT needs --label-key")
    prompt_ids = tokenizer.encode(_prompt_text(tokenizer, sample), add_special_tokens=False)
    response_ids = tokenizer.encode(str(sample.label), add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        response_ids.append(tokenizer.eos_token_id)
    sample.tokens = list(prompt_ids) + list(response_ids)
    sample.response = str(sample.label)
    sample.response_length = len(response_ids)
    sample.loss_mask = [1] * len(response_ids)
    sample.reward = 0.0
    sample.status = Status.COMPLETED
    return sample


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    if evaluation:
        return RolloutFnEvalOutput(data={})  # evaluate with the default rollout (--eval-function-path)
    tokenizer = load_tokenizer(args.hf_checkpoint)
    groups = data_source.get_samples(args.rollout_batch_size)
    out = [[build_sft_sample(tokenizer, s) for s in group] for group in groups]
    n = sum(len(g) for g in out)
    return RolloutFnTrainOutput(
        samples=out, metrics={"rollout/response_len_mean": sum(s.response_length for g in out for s in g) / max(n, 1)}
    )
