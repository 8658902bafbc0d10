"""`--update-weights-in-flight` on the real path: the weight-sync session pauses a (fake) SGLang server in place, so
a running request survives the sync and finishes under the new version, where the default pause cuts it; and the
per-token staleness helpers (`bound_answer_version`, `mask_tokens_older_than`, the `mask` rule)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from slime.backends.sglang.client import SGLangClient, end_weight_sync, start_weight_sync
from slime.scheduling.stale_rule import filter_stale_groups, mask_stale_group
from slime.scheduling.staleness import bound_answer_version, group_staleness, mask_tokens_older_than
from slime.utils.types import Sample

pytestmark = pytest.mark.cpu


def _generate(url: str, out: dict) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out.update(json.loads(r.read()))


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_request_runs_through_an_in_flight_sync_and_is_cut_by_a_drained_one(tmp_path, in_flight) -> None:
    from sim.fake_sglang.testing import launch_fake_sglang

    cfg = {"vocab_size": 100, "output_len": {"dist": "fixed", "value": 40},
           "token_latency_s": {"dist": "fixed", "value": 0.02}}  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    log = tmp_path / "log.jsonl"
    args = ["--engine", "synthetic", "--synthetic-config", str(tmp_path / "c.json"), "--request-log", str(log)]
    with launch_fake_sglang([*args, "--sglang-version", "0.5.23"]) as srv, SGLangClient(srv.url) as c:
        got: dict = {}
        t = threading.Thread(target=_generate, args=(srv.url, got))
        t.start()
        for _ in range(500):  # until it decodes
            if c.server_info()["internal_states"][0]["decode_steps"] > 3:
                break
            time.sleep(0.01)
        start_weight_sync([c], in_flight)()
        c._call("POST", "/update_weight_version", {"new_version": "7", "abort_all_requests": False})
        end_weight_sync([c])
        t.join(60)
    meta = got["meta_info"]
    if in_flight:  # kept in place: all 40 tokens, the version it finished under
        assert meta["finish_reason"]["type"] == "length" and len(got["output_ids"]) == 40
        assert meta["weight_version"] == "7"
    else:  # SGLang's default pause: answered at once as aborted with its tokens so far
        assert meta["finish_reason"]["type"] == "abort" and 0 < len(got["output_ids"]) < 40
    calls = [json.loads(line)["endpoint"] for line in log.read_text().splitlines()]
    assert ("/flush_cache" in calls) is not in_flight  # SGLang refuses a flush while requests are paused in place


def _sample(spans: list[list], loss_mask: list[int] | None = None) -> Sample:
    n = sum(k for _, k, _ in spans)
    s = Sample(index=0, group_index=0, tokens=[0] * (2 + n), response_length=n, loss_mask=loss_mask)
    s.weight_version_spans = [list(x) for x in spans]
    return s


def test_an_answer_through_a_sync_takes_the_version_it_was_sent_under() -> None:
    s = _sample([["3", 4, True], ["6", 5, True]])
    bound_answer_version(s, 4)  # the last answer was sent to engines at 4 and reported 6
    assert s.weight_version_spans == [["3", 4, True], ["4", 5, True]]
    bound_answer_version(s, None)  # drained (no bound known): unchanged
    same = _sample([["5", 2, True]])
    bound_answer_version(same, 5)
    assert same.weight_version_spans == [["5", 2, True]]


def test_tokens_older_than_the_bound_become_context_and_the_rest_trains() -> None:
    s = _sample([["1", 3, True], ["2", 2, True], ["4", 4, True]])
    assert mask_tokens_older_than(s, 2, dry_run=True) == 3 and s.loss_mask is None
    assert mask_tokens_older_than(s, 2) == 3
    assert s.loss_mask == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert [x[2] for x in s.weight_version_spans] == [False, True, True]
    assert group_staleness([s], 4) == 2
    # spans that do not cover the response (a generate function that reports no token counts): cannot tell
    assert mask_tokens_older_than(Sample(response_length=5, weight_version_spans=[["1", 3, True]]), 2) is None


def test_the_mask_rule_keeps_what_is_within_the_bound_and_drops_what_is_not() -> None:
    class Sink:
        def __init__(self) -> None:
            self.added: list = []

        def add_samples(self, groups: list) -> None:
            self.added += groups

    fresh = [_sample([["5", 3, True]])]
    partly = [_sample([["1", 3, True], ["4", 2, True]]), _sample([["4", 1, True]])]
    old = [_sample([["1", 3, True]])]
    assert mask_stale_group(old, 5, 2) is None and old[0].loss_mask is None  # nothing left: untouched
    sink = Sink()
    kept, dropped, counts = filter_stale_groups([fresh, partly, old], 5, 2, "mask", sink)
    assert kept == [fresh, partly] and dropped == [old] and not sink.added
    assert counts["async/stale_masked_groups"] == 1 and counts["async/stale_masked_tokens"] == 3
    assert partly[0].loss_mask == [0, 0, 0, 1, 1] and group_staleness(partly, 5) <= 2
