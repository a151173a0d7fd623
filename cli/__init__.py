"""The ``epd`` command and the launcher: the composition root, standing on the services, the
gateway and the ``epd`` library (which import nothing from here)."""

import os

# OpenMP threads that finish a parallel region sleep at once instead of spinning for the next
# one (an operator's setting wins). Every EPD service holds a pool of them (torch's), and on a
# host whose stages share the cores, each spinning pool takes CPU from the stages with work:
# E/P/D reached x0.80 and x0.71 of monolithic's saturation throughput with it against x0.69 and
# x0.69 without, in two pairs of image serving runs (BENCHMARKS.md, serving). libgomp reads it
# when torch loads it, so it is set here, before any command imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
