"""Component analyses beyond attention (issue 51): the output decomposed into embeddings, heads x source tokens,
MLPs and biases, with a ledger that closes the sum (docs/definitions.md, "Direct contributions")."""
from .decompose import decompose
from .result import LEDGER_RTOL, DecompositionResult

__all__ = ["LEDGER_RTOL", "DecompositionResult", "decompose"]
