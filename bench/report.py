"""Turns ``bench/results/*.json`` into BENCHMARKS.md and PNG plots. Every number in the table
comes from a result file, and each section quotes the command that produced it."""

from __future__ import annotations

import json
import pathlib

from bench.common import RESULTS_DIR, SCHEMA_VERSION, SERVING_EXPERIMENTS

REPO = pathlib.Path(__file__).resolve().parents[1]
KIB, MIB = 1024, 1024 * 1024


def _load(results_dir: pathlib.Path, name: str) -> dict | None:
    """A result of the current schema, or None (missing or stale)."""
    doc = _load_any(results_dir, name)
    return doc if doc is not None and doc.get("schema_version") == SCHEMA_VERSION else None


def _load_any(results_dir: pathlib.Path, name: str) -> dict | None:
    path = results_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB" if nbytes >= KIB else f"{nbytes} B"


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


# Issue 9's goal for the gateway's own overhead in the serving benchmark.
GATEWAY_SHARE_GOAL_PERCENT = 3


def _serving(doc: dict) -> list[str]:
    cfg, summary, ratios = doc["config"], doc["summary"], doc["ratios"]
    w = cfg["workload"]
    family = f", {cfg['family']}" if cfg.get("family") else ""
    lines = [
        f"## Serving ({w['modality']}{family}): metadata-only vs media forwarding, and topologies",
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
    shares = [
        f"{arm} {load} {s['gateway_overhead_ms_median'] / s['e2el_ms_median'] * 100:.1f} %"
        for arm, loads in summary.items()
        if arm != "monolithic"
        for load, s in loads.items()
    ]
    lines += [f"Gateway overhead over E2EL (medians; goal ≤ {GATEWAY_SHARE_GOAL_PERCENT:g} %): " + ", ".join(shares) + ".", ""]
    if "epd-go-relay" in summary:
        relay = summary["epd-go-relay"]
        gateways = [arm for arm in ("epd",) if arm in summary]
        lines += [
            "epd-go-relay sends the epd arm's requests through the same stages by way of EPD's data path alone, compiled "
            "(`bench/go_stages/relay.go`: no routing, retries, validation, spans or metrics; a measuring instrument, not a gateway). "
            "The relay's overhead is what remains with a compiled data path: the client sending the media and reading the stream, "
            "and the hops. The gateway's overhead over it, medians: "
            + "; ".join(
                f"{arm} " + ", ".join(f"{load} {_fmt(summary[arm][load]['gateway_overhead_ms_median'] - relay[load]['gateway_overhead_ms_median'], 1)} ms" for load in ("poisson", "saturation"))
                for arm in gateways
            )
            + "; saturation throughput over the relay's: "
            + ", ".join(f"{arm} ×{_fmt(summary[arm]['saturation']['request_throughput'] / relay['saturation']['request_throughput'], 3)}" for arm in gateways)
            + ".",
            "",
        ]
    inside = [
        f"{arm} {load} {_fmt(s['gateway_own_ms_median'], 2)} ms"
        for arm, loads in summary.items()
        if arm != "monolithic"
        for load, s in loads.items()
        if "gateway_own_ms_median" in s  # runs recorded before it was
    ]
    if inside:
        lines += [
            "Of that overhead, the gateway's own time (parsing and hashing, routing: its Finished timings' total minus the stage "
            "calls; the rest is the client's hop to it, which carries the media, and the client's reading), medians: " + ", ".join(inside) + ".",
            "",
        ]
    lines += ["Topologies over monolithic:", ""]
    for arm, loads in ratios["topologies_over_monolithic"].items():
        parts = ", ".join(f"{load}: throughput ×{_fmt(r['request_throughput'], 3)}, mean E2EL ×{_fmt(r['e2el_mean'], 3)}" for load, r in loads.items())
        lines.append(f"- {arm}: {parts}")
    end = doc["end_state"]
    encoder = end["encoder"]
    lines += [
        "",
        f"End state ({'all back to zero' if end['drained'] else 'NOT back to zero'}): {end['arena_leases']:g} arena leases; "
        "failed embedding loads: " + ", ".join(f"{name} {c['embedding_load_failures']:g}" for name, c in end["consumers"].items()) + "; "
        "engines (KV cache usage, requests running, waiting): "
        + ", ".join(f"{name} {e['kv_cache_usage']:g}/{e['requests_running']:g}/{e['requests_waiting']:g}" for name, e in end["engines"].items())
        + ".  ",
        "Embeddings loaded (MiB over NIXL / inline; items still held for vLLM's encoder cache): "
        + ", ".join(
            f"{name} {c['nixl_bytes_loaded'] / MIB:.1f} / {c['inline_bytes_loaded'] / MIB:.1f}; {c['receive_buffer_items']:g}" for name, c in end["consumers"].items()
        )
        + f".  \nEncoder: {encoder['items_encoded']:g} items in {encoder['engine_steps']:g} engine steps ({_fmt(encoder['mean_items_per_step'], 2)} items per step).  ",
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
    cfg = doc["config"]
    lines = [
        "## Embedding handoff: encoder arena to consumer encoder cache",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {_machine(doc)}  ",
        f"Per item, from the consumer's first call until the rows are usable as a tensor ({cfg['dtype']} rows; NIXL READs also move the "
        f"{cfg['slot_header_bytes']}-byte slot header). ec_consumer: ConsumerScheduler as vLLM's scheduler drives it; nixl_reader: NixlReader alone; "
        "raw_read: one NIXL READ through the agent; grpc_inline: the rows inline in an EncodeResponse, copied into a buffer; "
        "memcpy: an in-process copy (memcpy_fresh: from a different region each time). UCX: " + f"{cfg['ucx_tls']}; torch threads {cfg['torch_threads']}.",
        "",
        "| method | size | median µs | p99 µs | GB/s | samples |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        lines.append(f"| {r['method']} | {_size(r['bytes'])} | {_fmt(r['latency_us']['median'], 1)} | {_fmt(r['latency_us']['p99'], 1)} | {_fmt(r['gb_per_s'], 3)} | {r['latency_us']['count']} |")
    lines += ["", "Goals:", ""]
    lines += [f"- {g['goal']}: ×{_fmt(g['value'], 3)} ({'met' if g['met'] else 'NOT met'})" for g in doc["goals"]]
    lines += ["", "Throughput ratios and fixed cost:", ""]
    ratios = doc["ratios"]
    for key, label in (
        ("ec_consumer_over_memcpy", "ec_consumer throughput over memcpy's"),
        ("ec_consumer_over_memcpy_fresh", "ec_consumer over memcpy_fresh"),
        ("raw_read_over_memcpy", "raw_read over memcpy (what NIXL itself reaches)"),
    ):
        lines.append(f"- {label}: " + ", ".join(f"{_size(int(n))} ×{_fmt(v, 3)}" for n, v in ratios[key].items()))
    lines.append(
        "- Fixed cost over a raw READ (median µs, ec_consumer / nixl_reader): "
        + ", ".join(f"{_size(int(n))} {_fmt(c['ec_consumer_minus_raw_read_us'], 1)} / {_fmt(c['nixl_reader_minus_raw_read_us'], 1)}" for n, c in doc["fixed_cost_us"].items())
    )
    lines += ["", "| batched | items x size | one transfer median µs | one per item median µs | speedup |", "| --- | --- | --- | --- | --- |"]
    for b in doc["batched"]:
        lines.append(
            f"| {b['method']} | {b['items']} x {_size(b['item_bytes'])} | {_fmt(b['one_transfer_us']['median'], 1)} | {_fmt(b['per_item_transfers_us']['median'], 1)} | ×{_fmt(b['speedup'])} |"
        )
    first = ", ".join(f"{k} {_fmt(v, 1)} ms" for k, v in doc["first_contact_ms"].items())
    skipped = "".join(f" Not measured: {s['method']} at {_size(s['bytes'])} ({s['reason']})." for s in cfg.get("skipped", []))
    return [*lines, "", f"First contact (excluded above): {first}. Leases left at the end: {cfg['leases_left']}.{skipped}", ""]


def _cold_start(doc: dict) -> list[str]:
    c, cfg = doc["checkpoint"], doc["config"]
    commands = "; ".join(f"{mode}: `{command}`" for mode, command in cfg["commands"].items())
    lines = [
        "## Encoder cold start: vLLM encoder-only service vs a full engine, to ready",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {_machine(doc)}  ",
        f"Checkpoint: `{cfg['checkpoint']}`, {c['shards']} shards, {c['bytes'] / MIB:.1f} MiB of tensors. Services: {commands}. "
        f"Medians over {cfg['repeats']} starts; seconds from spawning the process.",
        "",
        "| mode | page cache | shards read (its log) | read from disk (shards, MiB) | to ready s median | p99 | to listening s | model load s | vLLM weights s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        disk = f"{r['shards_read_from_disk']}, {r['bytes_read_from_disk'] / MIB:.1f}" if "shards_read_from_disk" in r else "n/a (warm)"
        lines.append(
            f"| {r['mode']} | {r['page_cache']} | {r['shards_read']} of {r['shards_total']} | {disk} | {_fmt(r['seconds_to_ready']['median'], 2)} "
            f"| {_fmt(r['seconds_to_ready']['p99'], 2)} | {_fmt(r['seconds_to_listening']['median'], 2)} | {_fmt(r['load_model_seconds']['median'], 3)} "
            f"| {_fmt(r['weights_seconds']['median'], 2)} |"
        )
    ratios = ", ".join(f"{k} ×{_fmt(v, 2)}" for k, v in doc["ratios"].items() if v is not None)
    left_out = " Cold starts were left out: the checkpoint could not be evicted from the page cache." if cfg["cold_left_out"] else ""
    return [*lines, "", f"Ratios (full engine over encoder-only): {ratios}.{left_out}", ""]


def _encoder_throughput(doc: dict) -> list[str]:
    cfg, results = doc["config"], doc["results"]
    service, hf = results["vllm_service"], results["hf_tower"]
    stages = ", ".join(f"{stage} {_fmt(seconds, 3)} s" for stage, seconds in hf["stage_seconds_median"].items())
    return [
        "## Encoder throughput: vLLM's tower (encoder service) vs the HF tower",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {_machine(doc)}  ",
        f"Checkpoint `{cfg['checkpoint']}`, {cfg['dtype']}; {cfg['num_items']} JPEGs of {cfg['image_edge_px'][0]}-{cfg['image_edge_px'][1]} px "
        f"({min(cfg['embedding_rows'])}-{max(cfg['embedding_rows'])} embedding rows of {cfg['embedding_width']}); medians over {cfg['repeats']} passes.",
        "",
        "| encoder | items/s median | seconds per pass median | how |",
        "| --- | --- | --- | --- |",
        f"| vllm_service | {_fmt(service['items_per_s']['median'])} | {_fmt(service['seconds']['median'], 3)} | one Encode call per image over gRPC, all at once, "
        f"leases released; {_fmt(service['mean_batch_items'], 1)} items per engine step, mean Encode call {_fmt(service['mean_encode_call_ms'], 1)} ms |",
        f"| hf_tower | {_fmt(hf['items_per_s']['median'])} | {_fmt(hf['seconds']['median'], 3)} | in-process decode + HF processor + get_image_features, "
        f"batches of {cfg['hf_batch_items']}, {hf['torch_threads']} torch threads; {stages} |",
        "",
        f"Ratio (vLLM service over HF tower, items/s): ×{_fmt(doc['ratios']['vllm_service_over_hf_tower'], 3)}. "
        f"Arena leases at the end: {service['arena_leases_at_end']:g}.",
        "",
    ]


def _gateway_overhead(doc: dict) -> list[str]:
    latency, floor, added, ours = doc["latency_ms"], doc["direct_ms"], doc["added_ms"], doc["added_by_epd_ms"]
    relay, relay_added, go_relay, go_relay_added = doc["relay_ms"], doc["relay_added_ms"], doc["go_relay_ms"], doc["go_relay_added_ms"]
    goal = doc["goal_over_relay_p50_ms"]
    cpu, relay_cpu = doc["cpu_ms_per_request"], doc["relay_cpu_ms_per_request"]
    return [
        "## Gateway overhead, alone: the real gateway against stand-in stages that answer at once",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {_machine(doc)}  ",
        f"{doc['requests']} sequential E/P/D requests of one 224 px PNG and {doc['output_tokens']} output tokens (one per streamed message), "
        "after a warm-up. The stand-in encoder, prefill and decode do no work and are compiled (grpc-go, `bench/go_stages`), so a call to one "
        "costs next to nothing, and so is the client that times every path (`go_stages -role client`): every millisecond is the gateway's and its "
        "three hops'. The bare relays make the same three calls from their own process and relay the decode's stream message by message, with "
        "none of EPD's other work (no validation, hashing, routing, retries, spans or metrics): the grpc.aio one is the floor the gateway's runtime "
        "sets for this hop shape; the grpc-go one (`bench/go_stages/relay.go`, the stages' real protocol, which the serving experiments also run "
        "against real stages) what a compiled gRPC runtime costs for it, a measuring instrument. The paths take turns request by request. "
        "The gateway merges deltas its client has not read yet into one message (`gateway/run.py`), so against stand-ins that stream at once "
        "it may send fewer messages than the relays, and EPD's own work can come out below zero.",
        "",
        "| measure | median ms | p99 ms |",
        "| --- | --- | --- |",
        f"| Generate through the gateway | {_fmt(latency['median'])} | {_fmt(latency['p99'])} |",
        f"| the same request through the bare grpc.aio relay | {_fmt(relay['median'])} | {_fmt(relay['p99'])} |",
        f"| the same request through the bare grpc-go relay | {_fmt(go_relay['median'])} | {_fmt(go_relay['p99'])} |",
        f"| floor: the same tokens streamed straight from the stand-in decode (one hop) | {_fmt(floor['median'])} | {_fmt(floor['p99'])} |",
        f"| added by the gateway (per request, gateway minus floor) | {_fmt(added['median'])} | {_fmt(added['p99'])} |",
        f"| of which EPD's own work (per request, gateway minus grpc.aio relay) | {_fmt(ours['median'])} | {_fmt(ours['p99'])} |",
        f"| added by the bare grpc.aio relay (relay minus floor) | {_fmt(relay_added['median'])} | {_fmt(relay_added['p99'])} |",
        f"| added by the bare grpc-go relay (relay minus floor) | {_fmt(go_relay_added['median'])} | {_fmt(go_relay_added['p99'])} |",
        "",
        "Where the added time goes (medians, ms): at the first token (the per-request work and the three hops, what TTFT grows by), and per "
        f"later token (relaying one more streamed message; {doc['output_tokens'] - 1} here), so any output length costs the first plus that many "
        "times the second.",
        "",
        "| path | added at the first token | added per later token |",
        "| --- | --- | --- |",
        *(
            f"| {path} | {_fmt(doc[prefix + 'first_token_added_ms']['median'])} | {_fmt(doc[prefix + 'per_token_added_ms']['median'], 3)} |"
            for path, prefix in (("the gateway", ""), ("bare grpc.aio relay", "relay_"), ("bare grpc-go relay", "go_relay_"))
        ),
        "",
        f"CPU per request (user + system, all threads): gateway {_fmt(cpu)} ms, grpc.aio relay {_fmt(relay_cpu)} ms, grpc-go relay "
        f"{_fmt(doc['go_relay_cpu_ms_per_request'])} ms. "
        f"Goals: EPD's own work ≤ {_fmt(goal, 1)} ms p50 over the grpc.aio relay: {_fmt(ours['median'])} ms, {'met' if ours['median'] <= goal else 'not met'}; "
        f"CPU per request ≤ the grpc.aio relay's: {'met' if cpu <= relay_cpu else 'not met'}.",
        "",
    ]


def _h2_abuse(doc: dict) -> list[str]:
    goals = doc["goals"]
    lines = [
        "## HTTP/2 abuse of the gateway's public port",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {_machine(doc)}  ",
        f"One hostile client at a time for {doc['attack_s']:g} s (raw frames from its own process, `bench/h2_abuse.py`), while legitimate "
        f"one-image Generate calls arrive at {doc['legit_per_s']:g}/s, each on a new connection, with a {doc['legit_timeout_s']:g} s deadline. "
        "The gateway stands in front of compiled stand-in stages that answer at once. RSS is the gateway process's: before the attack, its peak "
        "during it, and once settled afterwards; after: legitimate calls once the attack has ended.",
        "",
        "| attack | attacker sent | legitimate calls ok | p50 / p99 ms | RSS before / peak / after MiB | gateway CPU s | after | goals |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        sent = r["attacker"]
        ms = r["legit_ms"]
        lines.append(
            f"| {r['attack']} | {sent.get('frames', 0)} frames on {sent.get('connections', 0)} connections ({sent.get('closed_by_server', 0)} closed by the gateway) "
            f"| {r['legit_ok']} / {r['legit_sent']} | {_fmt(ms['median'], 1) if ms else 'n/a'} / {_fmt(ms['p99'], 1) if ms else 'n/a'} "
            f"| {_fmt(r['rss_baseline_mib'], 0)} / {_fmt(r['rss_peak_mib'], 0)} / {_fmt(r['rss_after_mib'], 0)} | {_fmt(r['cpu_s'], 1)} "
            f"| {r['after_ok']} / {r['after_sent']} | {'met' if r['met'] else 'NOT MET'} |"
        )
    lines += [
        "",
        f"Goals, per attack: at least {goals['success'] * 100:g} % of the legitimate calls sent during it succeed; RSS grows at most "
        f"{goals['growth_mib']:g} MiB and comes back within {goals['left_mib']:g} MiB of where it was; every call afterwards succeeds.",
        "",
    ]
    return lines


def _seconds(value) -> str:
    return "never" if value is None else f"{value:.2f}"


def _encoder_cache(doc: dict) -> list[str]:
    tower = doc.get("vision_tower")
    tokens = doc.get("image_tokens")
    checkpoint = f"Checkpoint: `{pathlib.PurePath(doc['model']).name}`"
    if tower and tokens:
        checkpoint += (
            f", a vision tower of {tower['depth']} blocks {tower['hidden_size']} wide (MLP {tower['intermediate_size']}) "
            "in front of the tiny language model; "
            f"images keep up to {tower['max_image_tokens']} tokens, here {tokens['min']:.0f}-{tokens['max']:.0f} (median {tokens['median']:.0f})."
        )
    else:
        checkpoint += " (the tiny Qwen2.5-VL: its tower costs next to nothing)."
    if "distinct_monolithic_answers" in doc and doc["results"]:
        requests = doc["results"][0]["requests"]
        checkpoint += f" The monolithic run gave {doc['distinct_monolithic_answers']} different answers to the {requests} requests."
    lines = [
        "## Encoder-output reuse: half the items repeat",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {_machine(doc)}  ",
        f"{checkpoint}  ",
        f"Every image is asked about twice, the second time {doc['repeat_after']} requests later with another question (one image, 8 output tokens per request), "
        f"at most {doc['concurrency']} in flight, through one E/P/D gateway per arm over two encoders, one prefill and one decode (prefill and decode with `--no-caches`). "
        "Tower runs: the items vLLM scheduled for the tower (`epd_encoder_batch_items`, both encoders); "
        "cache hits: EPD's encoder-output cache; shared hits: those the shared tier served; "
        "vLLM cache: the items neither served, which vLLM's own encoder cache in the encoder engine answered. "
        "'No reuse', the baseline: EPD's cache off and every request's image sent as new bytes (the same pixels), so that no cache can answer "
        "a repeat and every item is encoded each time it is sent. 'EPD cache off': EPD's cache off and the workload as it is, so vLLM's own "
        "cache (2048 embeddings per encoder, not configurable through EPD) answers a repeat whose output is still resident. "
        "Encode: the gateway's encode stage (decode, vLLM's processor, the tower or a cache hit, queueing). "
        "TTFT first / repeat: the TTFT p50 of the requests that bring an image for the first time, and of those that bring it again. "
        + ("Each arm's engines are warmed up first, on other bytes." if doc.get("warmed_up") else "No warm-up pass: the first arm also paid for warming the engines."),
        "",
        "| arm | requests | unique images | tower runs | cache hits | shared hits | vLLM cache | encode p50 ms "
        "| TTFT p50 / p99 ms | TTFT p50 first / repeat ms | E2EL p50 / p99 ms | tokens equal monolithic | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        encode = r.get("encode_ms")
        lines.append(
            f"| {r['arm']} | {r['requests']} | {r['unique_items']} | {r['tower_runs']:.0f} | {r['cache_hits']:.0f} | {_fmt(r.get('shared_hits'), 0)} "
            f"| {_fmt(r.get('vllm_cache_answered'), 0)} | {_fmt(encode['median'] if encode else None, 0)} "
            f"| {_fmt(r['ttft_ms']['median'], 0)} / {_fmt(r['ttft_ms']['p99'], 0)} "
            f"| {_fmt(r.get('ttft_first_ms', {}).get('median'), 0)} / {_fmt(r.get('ttft_repeat_ms', {}).get('median'), 0)} "
            f"| {_fmt(r['e2el_ms']['median'], 0)} / {_fmt(r['e2el_ms']['p99'], 0)} "
            f"| {r['tokens_equal_monolithic']} of {r['requests']} | {r['failed']} |"
        )
    by_arm = {r["arm"]: r for r in doc["results"]}
    baseline, vllm_cache_only = "no reuse", "EPD cache off"  # the goal's baseline; a second one, not a cache
    off = by_arm.get(baseline)
    notes = []
    met, missed = [], []
    for arm, r in by_arm.items():
        if arm == baseline or not (off and off["ttft_ms"]["median"]):
            continue
        ratio = r["ttft_ms"]["median"] / off["ttft_ms"]["median"]
        notes.append(f"TTFT p50 of '{arm}': {ratio:.3f}x the '{baseline}' arm's.")
        if arm == vllm_cache_only:
            continue
        ok = ratio <= 0.5 and r["tower_runs"] == r["unique_items"] and not r["failed"] and r["tokens_equal_monolithic"] == r["requests"]
        (met if ok else missed).append(f"'{arm}'")
    if vllm_cache_only in by_arm and (only := by_arm[vllm_cache_only]["ttft_ms"]["median"]):
        against = ", ".join(f"'{arm}' {r['ttft_ms']['median'] / only:.3f}x" for arm, r in by_arm.items() if arm not in (baseline, vllm_cache_only))
        notes.append(f"Against '{vllm_cache_only}' (vLLM's cache alone): {against}.")
    notes.append(
        f"Goals: TTFT p50 ≤ 0.5x the '{baseline}' arm's, and one tower run per unique image (with every request's tokens equal to monolithic)."
    )
    if off:
        notes.append(f"Met by: {', '.join(met) or 'none'}; not by: {', '.join(missed) or 'none'}.")
    if "shared tier, affinity" not in by_arm:
        notes.append("This result predates the shared-tier arms (`epd shared-cache`): rerun the command for them.")
    return [*lines, "", " ".join(notes), ""]


def _gateway_impl(doc: dict) -> str:
    """Which gateway a resilience run put under load (runs before there were two: the Python one)."""
    return {"go": "compiled", "python": "Python"}[doc.get("gateway_impl", "python")]


def _faults(doc: dict) -> list[str]:
    lines = [
        "## Faults: SIGKILL of one of two instances of a stage under steady load",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {_machine(doc)}  ",
        f"Two encoders, two prefills and two decodes behind one E/P/D gateway ({_gateway_impl(doc)}); {doc['concurrency']} clients in a closed loop of one-image requests "
        f"({doc['output_tokens']} output tokens), {doc['load_s']:.0f} s of load before the kill and again after the restart. "
        "Gone: the kill until the instance's port refuses connections (its processes have exited, sockets last); eject: the kill until the gateway's "
        "`epd_stage_instance_up` for the instance reads 0 (both polled every 50 ms); rejoin: the restarted process ready until it reads 1.",
        "",
        "| killed | requests | failed | in flight on it, ended | failed, started after the kill | first success after the kill s | gone s | eject s | rejoin s | tokens differing | late KV notifications | KV releases | KV-lease retries | E2EL p50 / p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        lines.append(
            f"| {r['stage']} | {r['requests']} | {r['failed']} | {r['ended_in_flight']} | {r['failed_started_after_kill']} | {_seconds(r['first_success_after_kill_s'])} "
            f"| {_seconds(r.get('gone_s'))} | {_seconds(r['eject_s'])} | {_seconds(r.get('rejoin_s')) if 'rejoin_s' in r else 'n/a (not restarted)'} | {r['wrong_tokens']} "
            f"| {_fmt(r.get('late_kv_notifications'), 0)} | {_fmt(r.get('kv_releases'), 0)} | {_fmt(r.get('kv_lease_retries'), 0)} | {_fmt(r['e2el_ms']['median'], 0)} / {_fmt(r['e2el_ms']['p99'], 0)} |"
        )
    errors = "; ".join(f"{r['stage']}: {', '.join(r['errors'])}" for r in doc["results"] if r["errors"])
    goals = (
        "Goals: 0 failed for encoder and prefill; for decode, only streams in flight on it end (after their first token, so not retried) and 0 failures for requests started after the kill; "
        "0 tokens differing (successful requests whose greedy tokens differ from the same request's answer on the idle deployment before the load; "
        "`wrong_examples` in the result file says when each started and where it first differs); 0 late KV notifications "
        "(`vllm:nixl_num_notifications_after_expiry_total`, over the prefills alive at the end: a decode's notice for KV its prefill no longer held, "
        "such as a READ that ended after the lease had run out, when the blocks may hold another request's KV; in the decode run it can also be "
        "harmless: the gateway's release of KV that the killed decode had read just before it died, before its first token). KV releases: the gateway's "
        "`ReleaseKv` calls, over the decodes alive at the end, for requests that failed between prefill and a decode's answer. KV-lease retries: "
        "requests run again because a decode refused a handoff whose lease was about to run out (`epd_gateway_retries_total{stage=kv_lease}`)."
    )
    return [*lines, "", goals + (f" Errors seen: {errors}." if errors else ""), ""]


def _soak(doc: dict) -> list[str]:
    services = [k for k in doc["rss_mib"][0] if k != "requests"]
    lines = [
        "## Soak: requests at steady concurrency, nothing lost, nothing growing",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {_machine(doc)}  ",
        f"{doc['requests']} one-image E/P/D requests ({doc['output_tokens']} output tokens) through the {_gateway_impl(doc)} gateway "
        f"at concurrency {doc['concurrency']} in {doc['duration_s']:.0f} s. "
        f"Lost: {doc['lost']}{' (' + ', '.join(doc['errors']) + ')' if doc['errors'] else ''}. "
        f"E2EL p50 {_fmt(doc['e2el_ms']['median'], 0)} ms, p99 {_fmt(doc['e2el_ms']['p99'], 0)} ms; TTFT p50 {_fmt(doc['ttft_ms']['median'], 0)} ms, p99 {_fmt(doc['ttft_ms']['p99'], 0)} ms.",
        "",
        "RSS of each service's process tree (MiB), by requests completed:",
        "",
        "| requests | " + " | ".join(services) + " |",
        "| --- | " + " | ".join("---" for _ in services) + " |",
    ]
    for sample in doc["rss_mib"]:
        lines.append(f"| {sample['requests']} | " + " | ".join(f"{sample[s]:.0f}" for s in services) + " |")
    growth = ", ".join(f"{k} {v * 1024:.1f} KiB" for k, v in doc["rss_growth_mib_per_request_after_warmup"].items())
    end = ", ".join(f"{k} {v:g}" for k, v in doc["end_state"].items())
    return [*lines, "", f"Growth per request after the first sample: {growth}. After the load drained: {end}.", ""]


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
    ax.bar([f"{r['mode']}\n{r['page_cache']}" for r in rows], [r["seconds_to_ready"]["median"] for r in rows])
    ax.set_ylabel("seconds to ready (median)")
    ax.set_title("Cold start: vLLM encoder-only service vs full engine")
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
    for name, plot in [*((name, _plot_serving) for name in SERVING_EXPERIMENTS), ("cold_start", _plot_cold_start)]:
        doc = _load(results_dir, name)
        if doc:
            plot(doc, results_dir / f"{name}.png")
            written.append(results_dir / f"{name}.png")
    return written


SECTIONS = {  # in bench.common.EXPERIMENTS order
    "handoff": _handoff,
    "cold_start": _cold_start,
    "encoder_throughput": _encoder_throughput,
    "gateway_overhead": _gateway_overhead,
    "h2_abuse": _h2_abuse,
    **{name: _serving for name in SERVING_EXPERIMENTS},
    "encoder_cache": _encoder_cache,
    "faults": _faults,
    "soak": _soak,
}


def _shown(path: pathlib.Path) -> str:
    """A results folder as the report names it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def write_report(results_dir: pathlib.Path = RESULTS_DIR, out: pathlib.Path = REPO / "BENCHMARKS.md") -> pathlib.Path:
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m bench` (see README) from `bench/results/*.json`; each section quotes the command that",
        "produced its numbers. These machines are shared and noisy: compare the ratios within a section (measured",
        "side by side in one run), not absolute times across sections or runs.",
        "",
    ]
    for name, render in SECTIONS.items():
        doc = _load(results_dir, name)
        if doc is not None:
            try:
                lines += render(doc)
            except (KeyError, TypeError, ValueError) as exc:  # one odd file must not sink the others
                lines += [f"## {name}", "", f"Unreadable: `{name}.json` lacks what this report needs ({exc!r}); rerun `python -m bench --only {name}`.", ""]
        elif (stale := _load_any(results_dir, name)) is not None:
            lines += [f"## {name}", "", f"Stale: `{name}.json` has schema v{stale.get('schema_version')}, not v{SCHEMA_VERSION}; rerun `python -m bench --only {name}`.", ""]
        else:
            lines += [f"## {name}", "", f"Not run: no `{name}.json` in {_shown(results_dir)}; run `python -m bench --only {name}`.", ""]
    out.write_text("\n".join(lines))
    return out
