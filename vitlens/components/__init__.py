"""Component analyses beyond attention (issue 51): the output decomposed into embeddings, heads x source tokens,
MLPs and biases, with a ledger that closes the sum; the logit lens; token norms and artifact tokens
(docs/definitions.md, "Direct contributions", "Logit lens", "Token norms")."""
from .decompose import decompose
from .logit_lens import LogitLensResult, logit_lens
from .result import LEDGER_RTOL, DecompositionResult
from .token_norms import TokenNormsResult, token_norms

__all__ = ["LEDGER_RTOL", "DecompositionResult", "LogitLensResult", "TokenNormsResult", "decompose", "logit_lens",
           "token_norms"]
