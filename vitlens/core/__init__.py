"""What every layer of vitlens builds on, importing nothing of it but the kind registry (``vitlens.kinds``) and the
errors: ``ModelSpec`` (what every view needs to know about a model) and the attention and filter maths the model
families share."""
from .attention import attention_probs, attention_probs_in_rows, conv_filters, effective_weight
from .spec import ModelSpec, param_count_str

__all__ = ["ModelSpec", "attention_probs", "attention_probs_in_rows", "conv_filters", "effective_weight",
           "param_count_str"]
