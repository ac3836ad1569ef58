"""The helper layer of the model families: what more than one family uses, public here, so that a family module
imports this layer and ``vitlens.families.base`` and never another family's module (a family is a plug-in: its
module and its name on the import line of ``vitlens/families/__init__.py``; ``tests/test_family_plugins.py`` holds
every module of ``vitlens/families/`` to that).

- ``interface``: transformers modules that call their ``AttentionInterface`` (side: sdpa's call or eager's
  returned probabilities; inline: eager for the session).
- ``sdpa_calls``: reading a ``F.scaled_dot_product_attention`` call (the probabilities from its very arguments).
- ``readers``: reading the probabilities a module computes itself (at its dropout, its one softmax, what it returns).
- ``windows``: window geometry read through a model's own code (``StandIn``, ``record_windows``), poolings and
  token centres.
- ``hf``: Hugging Face plumbing: a family's declared model types, processor defaults and attention implementation
  (``HfTypes``), and what is derived from the registered families' declarations; the tower, its inputs and outputs.
- ``timm``: what timm's ViT-like families share (``TimmFamily``, the q_norm / k_norm side capture, the data config).
- ``mha``: ``nn.MultiheadAttention`` blocks (torchvision's and open_clip's ViTs, SigLIP's and CoCa's pools).
- ``openclip``: an open_clip model's image tower, preprocessing, output and attentional pool.
- ``patches``: a patch embedding read as a convolution of the pixels (a ``Conv2d``, or a linear layer over unfolded
  patches: Llama 4's, Gemma 4's): its grid, stride, filters and tokens per forward.

Nothing here registers a family, and nothing here imports a family module.
"""
