"""The bf16-under-load benchmark's comparison and report (bench/bf16_load.py); its run needs a bf16
stack of every arm and is the benchmark itself."""

from __future__ import annotations

from bench import bf16_load


def test_differences_name_each_parted_stream_and_where_it_parts():
    reference = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1]]
    outputs = [[1, 2, 3], [4, 0, 6], [0, 8, 9], [1, 1, 2]]
    assert bf16_load.differences(reference, outputs) == [
        {"request": 1, "first_differing_token": 1},
        {"request": 2, "first_differing_token": 0},
        {"request": 3, "first_differing_token": 2},  # one is a prefix of the other: they part where it ends
    ]


def test_the_report_counts_streams_over_repeats():
    same = {"differ_from_alone": [], "differ_from_monolithic_under_load": []}
    parted = {"differ_from_alone": [{"request": 0, "first_differing_token": 40}], "differ_from_monolithic_under_load": [{"request": 0, "first_differing_token": 40}]}
    doc = {
        "command": "python -m bench --only bf16_load",
        "machine": {"cpu": "cpu", "cores": 2, "memory_gib": 1, "gpu": "none", "python": "3", "torch": "2"},
        "config": {"checkpoint": "qwen2_5_omni-s0", "dtype": "bfloat16", "requests": 16, "max_tokens": 128, "concurrency": 16},
        "repeats": [{"monolithic": same, "epd": parted, "epd-combined": same}, {"monolithic": same, "epd": parted, "epd-combined": parted}],
    }
    lines = bf16_load.report(doc)
    assert "| monolithic | 0 of 32 (0.0 %) | 0 of 32 | - |" in lines
    assert "| epd | 2 of 32 (6.2 %) | 2 of 32 | 40 / 40 |" in lines
    assert "| epd-combined | 1 of 32 (3.1 %) | 1 of 32 | 40 / 40 |" in lines
    assert any("monolithic vLLM departs from its own alone run in 0 of 32 streams" in line and "E/P/D differs in 2 and E+PD in 1 of 32" in line for line in lines)
