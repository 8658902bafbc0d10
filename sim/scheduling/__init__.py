"""The scheduling simulator: slime's real loop driver, rollout and fully-async code against simulated engines and a
simulated trainer on a virtual clock (`run.py`). `bench/async_vs_sync.py` compares the modes; docs/async.md."""
