"""Component analyses beyond attention (issue 51): the output decomposed into embeddings, heads x source tokens,
MLPs and biases, with a ledger that closes the sum; the logit lens; activation patching; token norms and artifact
tokens; TextSpan; mean-ablation (docs/definitions.md, "Direct contributions", "Logit lens", "Token norms", "TextSpan",
"Mean-ablation")."""
from .ablation import MeanAblationResult, mean_ablate
from .decompose import decompose
from .logit_lens import LogitLensResult, logit_lens
from .patching import PatchingResult, patch_activations
from .result import LEDGER_RTOL, DecompositionResult
from .textspan import TextSpanResult, text_span
from .token_norms import TokenNormsResult, token_norms

__all__ = ["LEDGER_RTOL", "DecompositionResult", "LogitLensResult", "MeanAblationResult", "PatchingResult",
           "TextSpanResult", "TokenNormsResult", "decompose", "logit_lens", "mean_ablate", "patch_activations",
           "text_span", "token_norms"]
