"""slime: RL post-training for LLMs and LLM agents (Megatron-core training, SGLang rollout, Ray placement)."""

__version__ = "0.1.0"
