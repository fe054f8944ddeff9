"""The rough edges a new user hit: what `train` says when it stops or resumes, what --dry-run checks, errors
that come before the work (and before the heavy imports), and --help lines that give their defaults."""

from __future__ import annotations

import re
import time

import pytest


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_is_refused_at_once_when_the_hub_is_off_or_unreachable(monkeypatch, offline):
    import socket

    from recurfit.data.sources import iter_documents
    from recurfit.errors import RecurfitError
    from recurfit.io import hub
    from recurfit.model import loading

    for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    hub.hub_unavailable.cache_clear()
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        expected = "HF_HUB_OFFLINE is set"
    else:
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "https://huggingface.co")

        def no_route(address, timeout):
            raise OSError(101, "Network is unreachable")

        monkeypatch.setattr(socket, "create_connection", no_route)
        expected = "the Hub (huggingface.co) cannot be reached (Network is unreachable)"
    started = time.monotonic()
    with pytest.raises(
        RecurfitError, match=re.escape(f"Cannot load 'someone/some-model': it is not a local folder, and {expected}.")
    ):
        loading.load_config("someone/some-model")
    with pytest.raises(RecurfitError, match=re.escape(f"Cannot load the dataset 'someone/some-data': {expected}.")):
        list(iter_documents("hf:someone/some-data"))
    assert time.monotonic() - started < 2
    hub.hub_unavailable.cache_clear()
