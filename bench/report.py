"""Turns ``bench/results/*.json`` into BENCHMARKS.md and PNG plots. Every number in the table
comes from a result file, and each section quotes the command that produced it."""

from __future__ import annotations

import json
import pathlib

from bench.common import RESULTS_DIR

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load(results_dir: pathlib.Path, name: str) -> dict | None:
    path = results_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _fmt(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and value == value else "n/a"


def _machine(doc: dict) -> str:
    m = doc["machine"]
    return f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; torch {m['torch']}, Python {m['python']}"


_MEDIA = {
    "image": lambda w: f"JPEG images ({w['image_edge_px'][0]}-{w['image_edge_px'][1]} px)",
    "video": lambda w: f"MP4 clips at 10 fps ({w['clip_seconds'][0]:g}-{w['clip_seconds'][1]:g} s, {w['video_edge_px'][0]}-{w['video_edge_px'][1]} px)",
    "audio": lambda w: f"16 kHz WAV clips ({w['clip_seconds'][0]:g}-{w['clip_seconds'][1]:g} s)",
}


def _serving(doc: dict) -> list[str]:
    cfg, summary, ratios = doc["config"], doc["summary"], doc["ratios"]
    w = cfg["workload"]
    lines = [
        f"## Serving ({w['modality']}): metadata-only vs media forwarding, and topologies",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {_machine(doc)}  ",
        f"Model: `{cfg['model']}`; {w['num_requests']} requests of {w['items_per_request'][0]}-{w['items_per_request'][1]} "
        f"{_MEDIA[w['modality']](w)} and {w['max_tokens']} output tokens each, "
        f"seed {cfg['workload']['seed']}; Poisson at {cfg['rate']} req/s and a saturation run (all at once); medians over {cfg['repeats']} repeats; "
        f"engine prefix and multimodal caches {cfg['caches']}.",
        "",
        "| arm | load | req/s | output tok/s | TTFT median ms | TPOT median ms | E2EL mean ms | E2EL p99 ms | encode / prefill / decode median ms | gateway overhead p50 / p99 ms | tokens = monolithic |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, loads in summary.items():
        for load, s in loads.items():
            stages = " / ".join(_fmt(s["stage_ms_median"][k], 1) for k in ("encode", "prefill", "decode"))
            lines.append(
                f"| {arm} | {load} | {_fmt(s['request_throughput'])} | {_fmt(s['output_throughput'], 1)} | {_fmt(s['ttft_ms_median'], 1)} | {_fmt(s['tpot_ms_median'], 1)} "
                f"| {_fmt(s['e2el_ms_mean'], 1)} | {_fmt(s['e2el_ms_p99'], 1)} | {stages} | {_fmt(s['gateway_overhead_ms_median'], 1)} / {_fmt(s['gateway_overhead_ms_p99'], 1)} "
                f"| {'yes' if doc['outputs_identical_to_monolithic'][arm] else 'NO'} |"
            )
    ab = ratios["metadata_only_over_media_forwarding"]
    lines += ["", "Ratios (metadata-only / media forwarding; throughput > 1 and latency < 1 favour metadata-only):", ""]
    for load, r in ab.items():
        lines.append(f"- {load}: request throughput ×{_fmt(r['request_throughput'], 3)}, mean E2EL ×{_fmt(r['e2el_mean'], 3)}, median TTFT ×{_fmt(r['ttft_median'], 3)}")
    lines += ["", _ab_analysis(summary, ab), ""]
    lines += ["Topologies over monolithic:", ""]
    for arm, loads in ratios["topologies_over_monolithic"].items():
        parts = ", ".join(f"{load}: throughput ×{_fmt(r['request_throughput'], 3)}, mean E2EL ×{_fmt(r['e2el_mean'], 3)}" for load, r in loads.items())
        lines.append(f"- {arm}: {parts}")
    end = doc["end_state"]
    drained = end["arena_leases"] == 0 and all(e["kv_cache_usage"] == 0 and e["requests_running"] == 0 and e["requests_waiting"] == 0 for e in end["engines"].values())
    lines += [
        "",
        f"End state ({'all back to zero' if drained else 'NOT back to zero'}): {end['arena_leases']:g} arena leases; engines (KV cache usage, requests running, waiting): "
        + ", ".join(f"{name} {e['kv_cache_usage']:g}/{e['requests_running']:g}/{e['requests_waiting']:g}" for name, e in end["engines"].items())
        + ".  ",
        "Peak RSS (MiB, process tree): " + ", ".join(f"{name} {r['peak_rss_mib']:g}" for name, r in doc["resources"].items()) + ".",
        "",
    ]
    return lines


def _ab_analysis(summary: dict, ab: dict) -> str:
    """Says plainly whether metadata-only won here, and which stage decides it."""
    r = ab["saturation"]["request_throughput"]
    forward, meta = summary["epd-forward-media"]["saturation"], summary["epd"]["saturation"]
    stages_f, stages_m = forward["stage_ms_median"], meta["stage_ms_median"]
    dominant = max(stages_m, key=lambda stage: stages_m[stage])
    text = (
        f"{'Metadata-only is faster here' if r > 1 else 'Metadata-only is NOT faster here'} (saturation throughput ×{_fmt(r, 3)}). "
        f"Media forwarding re-decodes and re-processes every item in prefill and decode: at saturation their medians are "
        f"{_fmt(stages_f['prefill'], 1)} vs {_fmt(stages_m['prefill'], 1)} ms (prefill) and {_fmt(stages_f['decode'], 1)} vs {_fmt(stages_m['decode'], 1)} ms "
        f"(decode), forwarding vs metadata-only. The {dominant} stage dominates metadata-only E/P/D "
        f"({_fmt(stages_m[dominant], 1)} of {_fmt(meta['e2el_ms_median'], 1)} ms median E2EL)."
    )
    if r <= 1:
        text += f" So on this machine the processor re-run is small next to {dominant}, and the difference is within the noise."
    return text


def _handoff(doc: dict) -> list[str]:
    lines = ["## Embedding handoff", "", f"Command: `{doc['command']}`  ", f"Machine: {_machine(doc)}", "",
             "| method | bytes | median µs | p99 µs | GB/s |", "| --- | --- | --- | --- | --- |"]
    for r in doc["results"]:
        lines.append(f"| {r['method']} | {r['bytes']} | {_fmt(r['latency_us']['median'], 1)} | {_fmt(r['latency_us']['p99'], 1)} | {_fmt(r['gb_per_s'], 3)} |")
    lines += ["", "| batched | items x bytes | one transfer median µs | one per item median µs | speedup |", "| --- | --- | --- | --- | --- |"]
    for b in doc["batched"]:
        lines.append(f"| {b['method']} | {b['items']} x {b['item_bytes']} | {_fmt(b['one_transfer_us']['median'], 1)} | {_fmt(b['per_item_transfers_us']['median'], 1)} | ×{_fmt(b['speedup'])} |")
    ratios = ", ".join(f"{k} ×{_fmt(v, 3)}" for k, v in doc["ratios"].items())
    first = ", ".join(f"{k} {_fmt(v, 1)} ms" for k, v in doc["first_contact_ms"].items())
    skipped = "".join(f" Not measured: {s['method']} at {s['bytes']} bytes ({s['reason']})." for s in doc["config"].get("skipped", []))
    return [*lines, "", f"Ratios ({doc['config']['ratio_definition']}): {ratios}. First contact (excluded above): {first}.{skipped}", ""]


def _cold_start(doc: dict) -> list[str]:
    c = doc["checkpoint"]
    lines = ["## Encoder cold start", "", f"Command: `{doc['command']}`  ", f"Machine: {_machine(doc)}  ",
             f"Checkpoint: `{doc['config']['checkpoint']}`, {c['shards']} shards, {c['bytes']} bytes ({c['vision_bytes']} vision, {c['language_bytes']} language).", "",
             "| mode | page cache | shards read | bytes read | seconds median | seconds p99 |", "| --- | --- | --- | --- | --- | --- |"]
    for r in doc["results"]:
        lines.append(f"| {r['mode']} | {r['page_cache']} | {r['shards_read']} | {r['bytes_read']} | {_fmt(r['seconds']['median'], 3)} | {_fmt(r['seconds']['p99'], 3)} |")
    ratios = ", ".join(f"{k} ×{_fmt(v, 1)}" for k, v in doc["ratios"].items() if v is not None)
    return [*lines, "", f"Ratios: {ratios}.", ""]


def _plot_serving(doc: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(doc["summary"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(axes, ("request_throughput", "e2el_ms_mean", "ttft_ms_median"), ("requests/s", "mean E2EL (ms)", "median TTFT (ms)"), strict=True):
        for offset, load in ((-0.2, "poisson"), (0.2, "saturation")):
            ax.bar([i + offset for i in range(len(arms))], [doc["summary"][a][load][key] for a in arms], width=0.4, label=load)
        ax.set_xticks(range(len(arms)), arms, rotation=20)
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"Serving ({doc['config']['workload']['modality']}): medians over repeats")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_cold_start(doc: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([f"{r['mode']}\n{r['page_cache']}" for r in rows], [r["seconds"]["median"] for r in rows])
    ax.set_ylabel("seconds (median)")
    ax.set_title("Encoder cold start: encoder-only vs full checkpoint")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_plots(results_dir: pathlib.Path = RESULTS_DIR) -> list[pathlib.Path]:
    """PNG plots next to the results; skipped, with a notice, without matplotlib
    (``pip install -e .[bench]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("[bench] matplotlib is not installed: no plots (pip install -e .[bench])")
        return []
    written = []
    for name, plot in (("serving", _plot_serving), ("serving_video", _plot_serving), ("serving_audio", _plot_serving), ("cold_start", _plot_cold_start)):
        doc = _load(results_dir, name)
        if doc:
            plot(doc, results_dir / f"{name}.png")
            written.append(results_dir / f"{name}.png")
    return written


def write_report(results_dir: pathlib.Path = RESULTS_DIR, out: pathlib.Path = REPO / "BENCHMARKS.md") -> pathlib.Path:
    sections = {"serving": _serving, "serving_video": _serving, "serving_audio": _serving, "handoff": _handoff, "cold_start": _cold_start}
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m bench` (see README) from `bench/results/*.json`; each section quotes the command that",
        "produced its numbers. These machines are shared and noisy: compare the ratios within a section (measured",
        "side by side in one run), not absolute times across sections or runs.",
        "",
    ]
    for name, render in sections.items():
        doc = _load(results_dir, name)
        lines += render(doc) if doc else [f"## {name}", "", f"Not run: no `{name}.json` in {results_dir}.", ""]
    out.write_text("\n".join(lines))
    return out
