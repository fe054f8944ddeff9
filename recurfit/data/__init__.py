"""Training data: sources of text, packed token stores, and the deterministic order phases and mixtures give."""

from .prepare import prepare
from .sources import iter_documents
from .store import TokenStore
from .stream import Phase, RowStream

__all__ = ["Phase", "RowStream", "TokenStore", "iter_documents", "prepare"]
