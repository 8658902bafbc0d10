"""Training on megatron-core (local layer spec, no TransformerEngine).

Modules (import them directly; this package imports no megatron so `import slime` stays cheap — megatron's
import costs ~2.5 s with `lean_import`, ~7 s without):

- `backend`: `MegatronBackend`, the `TrainBackend` of every role (slime/backends/train_backend.py): the role's
  trainer, offload, checkpoints and the weight-sync transports (`weight_sync`, `weight_sync_distributed`).
- `trainer`: `MegatronTrainer`, one rank's RL step; `critic`: PPO's `CriticTrainer`; `trainer_setup`: the set-up
  steps; `microbatch`: `MicroBatch`; `sync_sources`, `hf_checkpoint`: what a sync reads, `--save-hf`.
- `initialize`: `init_distributed(args, rank, world_size, master_addr, master_port)`, then
  `init_megatron(args) -> MegatronParallelState` (runs `--custom-megatron-init-path`, e.g. the CPU shim).
- `parallel_state`: `MegatronParallelState`, the `slime.parallel_state.ParallelState` over megatron's groups.
- `hf_config`: `read_hf_config(hf_checkpoint) -> HFModelSpec`, `transformer_config_kwargs`, `padded_vocab_size`.
- `model_provider`: `build_gpt_model(args, spec)`, `model_provider(args, spec)`, `gpt_layer_spec(spec)`.
- `attention`: `SDPACoreAttention`, the core attention for packed (THD) sequences, GQA, CPU and GPU.
- `rope`: `PositionalRotaryEmbedding`, RoPE angles from each packed token's own position (shared prompts).
- `hf_weights`: `load_hf_weights(model, hf_dir, spec, ps)`, `export_hf_weights(model, spec, ps, bucket_bytes)`.
- `packing`: `pack_samples(token_lists, pad_multiple, prompt_lengths=None)` (with prompt lengths, samples of
  one prompt share its rows), `unpack`, `unpack_logits`.
- `context_parallel`: a packed row's zigzag share per CP rank, K/V gathered over the CP group, response
  tokens scored per rank and gathered back in sample order.
- `pipeline_runs`: `PipelineRunner`, megatron's pipeline schedules over a rank's model chunk(s).
- `rank_layout`: megatron's rank order (tp-cp-ep-dp-pp) without megatron; `slime plan` and the simulator use it.
"""

from slime.backends.megatron import lean_import

lean_import.install()  # the first `import megatron.core` skips what slime never uses (lean_import.py)
