"""Features of the residual stream (issue 66): sparse autoencoders trained on a named site's tokens as the images
stream (``train_sae``, on one machine or on Ray Data's workers), measured on held-out images (``evaluate_sae``), saved
and loaded in vitlens's layout and in SAELens's, ViT-Prisma's and saev's (``save_sae``, ``load_sae``); linear probes
of the class at every block (``linear_probes``). docs/definitions.md, "Sparse autoencoder" and the entries after it.
"""
from __future__ import annotations

from .activations import SiteBatch, iter_site_batches, iter_sites, select_tokens
from .evaluate import SAEEvaluationResult, evaluate_sae
from .files import load_sae, save_sae
from .model import SAE_KINDS, TOKEN_SETS, SAEConfig, SparseAutoencoder
from .probes import LinearProbeResult, linear_probes
from .result import SAETrainingResult
from .train import train_sae

__all__ = ["LinearProbeResult", "SAEConfig", "SAEEvaluationResult", "SAETrainingResult", "SAE_KINDS", "SiteBatch",
           "SparseAutoencoder", "TOKEN_SETS", "evaluate_sae", "iter_site_batches", "iter_sites", "linear_probes",
           "load_sae", "save_sae", "select_tokens", "train_sae"]
