"""Simulation harness: CPU stand-ins for Megatron ranks and SGLang servers. Never imported by `slime/`."""
