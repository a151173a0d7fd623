"""Development tooling: the tiny random-weight checkpoints the tests, the benchmarks and the demo
run on (:mod:`devkit.checkpoints`), and synthetic media (:mod:`devkit.media`). No service
imports it."""
