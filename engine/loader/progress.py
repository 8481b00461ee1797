"""The progress bar every loader shows on stderr."""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress_bar(items: Iterable[T], total: int, description: str, enabled: bool) -> Iterable[T]:
    return tqdm(items, total=total, desc=description, unit="tensor", file=sys.stderr, disable=not enabled,
                leave=False, dynamic_ncols=True)
