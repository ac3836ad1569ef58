"""Component analyses beyond attention (issue 51): the output decomposed into embeddings, heads x source tokens,
MLPs and biases, with a ledger that closes the sum; the logit lens; activation patching; token norms and artifact
tokens; TextSpan; mean-ablation (docs/definitions.md, "Direct contributions", "Logit lens", "Token norms", "TextSpan",
"Mean-ablation"); the authors' conventions by name beside vitlens's (issue 65: "Norm conventions")."""
from .ablation import MeanAblationResult, mean_ablate
from .decompose import decompose
from .logit_lens import LogitLensResult, logit_lens
from .patching import PatchingResult, patch_activations
from .result import LEDGER_RTOL, DecompositionResult
from .textbank import read_texts, text_bank
from .textspan import TextSpanResult, text_span
from .textspan_eval import TextSpanEvaluation, evaluate_text_span
from .token_norms import TokenNormsResult, token_norms

__all__ = ["LEDGER_RTOL", "DecompositionResult", "LogitLensResult", "MeanAblationResult", "PatchingResult",
           "TextSpanEvaluation", "TextSpanResult", "TokenNormsResult", "decompose", "evaluate_text_span",
           "logit_lens", "mean_ablate", "patch_activations", "read_texts", "text_bank", "text_span", "token_norms"]
