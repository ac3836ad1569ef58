"""Features of the residual stream (issue 66): sparse autoencoders trained on a named site's tokens as the images
stream, measured on held-out images, saved and loaded (docs/definitions.md, "Sparse autoencoder")."""
from __future__ import annotations

from .activations import SiteBatch, iter_site_batches, select_tokens
from .files import load_sae, save_sae
from .model import SAE_KINDS, TOKEN_SETS, SAEConfig, SparseAutoencoder

__all__ = ["SAEConfig", "SAE_KINDS", "SiteBatch", "SparseAutoencoder", "TOKEN_SETS", "iter_site_batches", "load_sae",
           "save_sae", "select_tokens"]
