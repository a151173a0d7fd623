"""EPD benchmarks: ratios measured side by side in one run (see BENCHMARKS.md)."""
