"""Fake SGLang server (`python -m sim.fake_sglang`) and mock router, speaking SGLang 0.5.23's HTTP API."""
