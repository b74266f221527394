"""Redis URLs as the package shows them: in logs, errors and ``celery redislock``'s output."""

from __future__ import annotations

import re

__all__ = ["masked"]


def masked(url: str) -> str:
    """``url`` with every password shown as ``**``: before each host (one per listed URL), and
    in the query (``?password=``, which redis-py reads as well)."""
    url = re.sub(r"(://[^:@/;,]*:)[^@/;]*@", r"\1**@", url)
    return re.sub(r"([?&]password=)[^&;#]*", r"\1**", url)
