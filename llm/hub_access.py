"""Reaching the Hugging Face hub without waiting on a machine that cannot.

With no network and without ``HF_HUB_OFFLINE=1``, huggingface_hub retries each request with backoff (25-30 s
before its error). Before the first hub request of a command, ``offline_unless_reachable`` opens one TCP
connection to the hub's endpoint (a few seconds at most); when that fails it switches huggingface_hub,
transformers and datasets to offline mode for the process (their public ``HF_HUB_OFFLINE`` setting), so a
cached snapshot answers at once and a missing one fails at once, with a message naming ``HF_HUB_OFFLINE`` and the
cache.
"""

from __future__ import annotations

import os
import socket
import sys
from urllib.parse import urlparse

__all__ = ["OFFLINE_HINT", "hub_unreachable", "offline_unless_reachable"]

PROBE_TIMEOUT_S = 3.0
OFFLINE_HINT = ("the hub is unreachable, so only local paths and the cache (HF_HOME) were tried; set HF_HUB_OFFLINE=1 "
                "to skip the check")


def hub_unreachable() -> str | None:
    """Why the hub's endpoint (``HF_ENDPOINT``) cannot be reached, or None when a TCP connection opens."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as err:
        return f"{url.hostname}:{port}: {err.strerror or err}"
    return None


def offline_unless_reachable() -> str | None:
    """Offline mode for this process when the hub cannot be reached (why, for messages); None when it can or when
    offline mode is already on (``HF_HUB_OFFLINE=1``: nothing is probed)."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return None
    if (reason := hub_unreachable()) is not None:
        os.environ["HF_HUB_OFFLINE"] = "1"  # for processes started from here (data workers) and later imports
        constants.HF_HUB_OFFLINE = True  # read at each request by huggingface_hub and transformers
        if "datasets.config" in sys.modules:  # datasets copies the setting when imported
            sys.modules["datasets.config"].HF_HUB_OFFLINE = True
    return reason
