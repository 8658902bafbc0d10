"""bench/run_cpu.py groups a run's processes into roles; the table is only as right as that grouping."""

import pytest

from bench.run_cpu import role, summarize

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(
    ("cmdline", "name", "want"),
    [
        ("ray::TrainRayActor.train", "python", "ray::TrainRayActor"),
        ("ray::IDLE", "python", "ray::IDLE"),
        ("/x/python -m sim.fake_sglang --host 127.0.0.1 --engine hf", "python", "fake engine"),
        ("/x/python -m sglang_router.launch_router --port 1", "sglang::router", "sglang router"),
        ("/x/python /x/.venv/bin/slime train --num-rollout 3", "python", "driver"),
        ("/x/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/s", "raylet", "ray raylet"),
        ("/x/python /x/ray/dashboard/dashboard.py --host=127.0.0.1", "python", "ray dashboard"),
        ("/usr/bin/ldconfig -p", "ldconfig", "ldconfig"),
    ],
)
def test_role(cmdline, name, want):
    assert role(cmdline, name) == want


def test_summarize_sums_per_role_and_keeps_the_first_start():
    rows = summarize({
        1: {"role": "fake engine", "cpu_s": 9.0, "start_s": 18.0},
        2: {"role": "fake engine", "cpu_s": 10.5, "start_s": 16.5},
        3: {"role": "driver", "cpu_s": 5.0, "start_s": 0.0},
    })  # fmt: skip
    assert rows == [
        {"role": "fake engine", "processes": 2, "cpu_s": 19.5, "first_start_s": 16.5},
        {"role": "driver", "processes": 1, "cpu_s": 5.0, "first_start_s": 0.0},
    ]
