"""``python -m bench.handoff``: the handoff experiment alone."""

from bench.handoff.experiment import main

main()
