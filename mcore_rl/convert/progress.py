"""The progress bar of conversions (tqdm on stderr, in bytes)."""
from __future__ import annotations

from tqdm import tqdm


def progress_bar(total_bytes: int, description: str, enabled: bool = True) -> tqdm:
    """A byte-counting bar; silent when ``enabled`` is false."""
    return tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True,
                unit_divisor=1024, disable=not enabled, dynamic_ncols=True)
