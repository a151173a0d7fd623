"""The chaos benchmark's short form (issue 31): under steady load through two encoders, prefills
and decodes, one instance of each stage is SIGKILLed in random order and restarted at its
address. No request fails, every greedy reply equals its oracle (resumed ones: the monolithic
run given the prompt and the tokens before the resume), and arena leases
and KV are back to 0 once the load drains. The five-minute form is ``python -m bench --only chaos``."""

from __future__ import annotations

import json

from bench import chaos


def test_killing_each_stage_under_load_fails_no_request_and_changes_no_token(tmp_path):
    doc = json.loads(chaos.run(quick=True, results_dir=tmp_path, command="pytest tests/test_chaos.py").read_text())
    print("\n".join(chaos.report(doc)))
    assert doc["failed"] == 0, doc["errors"]
    assert doc["wrong_tokens"] == 0, doc["wrong_examples"]
    assert sorted(k["instance"][:-1] for k in doc["kills"]) == ["decode", "encoder", "prefill"]
    assert all(k["eject_s"] is not None and k["rejoin_s"] is not None for k in doc["kills"]), doc["kills"]
    assert doc["requests"] > 0 and doc["end_state"] and all(v == 0 for v in doc["end_state"].values()), doc["end_state"]
    # The decode died with streams on it (8 clients, 192 tokens each): they were resumed, not failed.
    assert doc["resumed_replies"] >= 1 and doc["resumes"], doc["resumes"]
