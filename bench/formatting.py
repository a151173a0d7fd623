"""What every experiment's report section shares: numbers, sizes and the machine, worded alike."""

from __future__ import annotations

KIB, MIB = 1024, 1024 * 1024


def size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB" if nbytes >= KIB else f"{nbytes} B"


def fmt(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and value == value else "n/a"


def machine(doc: dict) -> str:
    m = doc["machine"]
    return f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; torch {m['torch']}, Python {m['python']}"


def seconds(value) -> str:
    return "never" if value is None else f"{value:.2f}"
