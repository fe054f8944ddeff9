"""Whether the Hugging Face Hub can be used now: asked before a Hub id is fetched, so that an offline machine
hears it at once instead of after the download's retries."""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


@functools.cache
def hub_unavailable() -> str | None:
    """Why the Hub cannot be used (HF_HUB_OFFLINE, or no connection to it within 3 s), or None."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None  # reached through a proxy: let the download find out
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as problem:
        return f"the Hub ({host}) cannot be reached ({problem.strerror or problem})"
    return None
