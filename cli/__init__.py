"""The ``epd`` command and the launcher: the composition root, standing on the services, the
gateway and the ``epd`` library (which import nothing from here)."""

import os

# OpenMP threads that finish a parallel region sleep at once instead of spinning for the next
# one (an operator's setting wins). Every EPD service holds a pool of them (torch's), and on a
# host whose stages share the cores, each spinning pool takes CPU from the stages (and from the
# service's own other threads) with work. With it every serving topology's saturation
# throughput rose on a 2-core AMD host (serving benchmark at issue 32's stop 40: monolithic
# images 18 -> 22 req/s, E/P/D 11 -> 14) and the test suite took 27 minutes instead of 33. libgomp reads it when torch
# loads it, so it is set here, before any command imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
