"""Numbers as people read them in logs and the dry run."""


def human(n: float) -> str:
    """1234567 -> '1.23M': three significant digits and a K/M/B/T/P suffix."""
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.2f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.2f}P"


def count(n: int, noun: str) -> str:
    """count(1, "micro-batch") -> '1 micro-batch', count(4, ...) -> '4 micro-batches'."""
    if n == 1:
        return f"1 {noun}"
    return f"{n:,} {noun}{'es' if noun.endswith(('ch', 'sh', 's', 'x')) else 's'}"
