"""``python -m bench``: the whole suite (embedding handoff through the EC connector, encoder cold
start, encoder throughput, the gateway's own overhead, serving A/B and topologies for images, video, audio and an Omni
thinker), then BENCHMARKS.md. On a 2-core CPU host it takes about half an hour; the flags scale
the same experiments up for GPUs."""

from __future__ import annotations

import argparse
import pathlib
import time

from bench.common import EXPERIMENTS, RESULTS_DIR, command_line, progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run of every experiment (minutes)")
    parser.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma-separated subset of {', '.join(EXPERIMENTS)}")
    parser.add_argument(
        "--model",
        default=None,
        help="serving*: checkpoint directory (default: the tiny Qwen2.5-VL; Qwen3-VL for video, Qwen2-Audio for audio, Qwen2.5-Omni for omni)",
    )
    parser.add_argument("--rate", type=float, default=None, help="serving: Poisson request rate per second")
    parser.add_argument("--num-requests", type=int, default=None, help="serving: requests per run")
    parser.add_argument("--duration-s", type=float, default=None, help="serving: seconds of arrivals per run (sets --num-requests from --rate); chaos: seconds of load")
    parser.add_argument("--max-concurrency", type=int, default=None, help="serving: most requests in flight (arrivals wait for a slot)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per measurement (medians are reported)")
    parser.add_argument("--iterations", type=int, default=None, help="handoff: transfers per size")
    parser.add_argument("--num-items", type=int, default=None, help="encoder_throughput: images per pass")
    parser.add_argument("--results-dir", type=pathlib.Path, default=RESULTS_DIR)
    parser.add_argument(
        "--report", type=pathlib.Path, default=None, help="where to write BENCHMARKS.md (default: the repo root for the committed results, else beside the results)"
    )
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(EXPERIMENTS))
    if unknown:
        parser.error(f"unknown experiments: {', '.join(unknown)}")
    started = time.perf_counter()
    for name in chosen:
        progress(f"{name}: starting")
        experiment = EXPERIMENTS[name]
        options = {option: getattr(args, option) for option in experiment.options}
        # The command recorded with the result reruns this experiment alone.
        path = experiment.module().run(quick=args.quick, results_dir=args.results_dir, command=command_line(only=name), **dict(experiment.fixed), **options)
        progress(f"{name}: wrote {path}")
    from bench.report import write_plots, write_report

    write_plots(args.results_dir)
    # A scratch results directory must not turn the committed BENCHMARKS.md into its own partial report.
    out = args.report or (None if args.results_dir.resolve() == RESULTS_DIR.resolve() else args.results_dir / "BENCHMARKS.md")
    report = write_report(args.results_dir, **({"out": out} if out else {}))
    progress(f"wrote {report} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
