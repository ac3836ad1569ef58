"""Text targets: explain an image-text model's similarity to a prompt instead of a class.

For a model with a text tower (OpenCLIP ``CLIP`` / ``CustomTextCLIP``, Hugging Face ``CLIPModel``,
``SiglipModel``), ``attribute(m, images, method=..., target="a photo of a dog")`` explains

    s(x) = cos(image_embedding(x), text_embedding(prompt))

the cosine similarity between the model's projected image embedding (what ``m.forward`` returns)
and the prompt's text embedding, for CLIP and SigLIP alike. (SigLIP's logit is
``exp(logit_scale) * s + logit_bias``, a positive affine function of ``s``: its gradient maps are
``exp(logit_scale)`` times these, its occlusion drops too, and the ranking of tokens is the same.)
The text embeddings are computed once, without gradients, so every method sees a scorer
``x -> [B, P]`` (the similarity to each of the P distinct prompts) and a target index per image,
the very code path class targets take.

Prompts are tokenised with the model's own tokenizer: ``open_clip.get_tokenizer(ARCH)`` for
``open_clip:ARCH`` names (open_clip's default BPE tokenizer for a CLIP built in code with its
49,408-token vocabulary); for Hugging Face models the tokenizer saved with the checkpoint
(``hf:FOLDER`` with tokenizer files, or ``m.tokenizer`` / ``tokenizer=``). A target may also be
pre-tokenised: a mapping with ``input_ids`` [P, L] (and optionally ``attention_mask``), one row per
image or one row for all, e.g. what a Hugging Face tokenizer returns.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import InvalidParameterError
from ..loading.model import LoadedModel

#: what the score of a text target is, in words (the result's ``params['score']``)
SCORE = "cosine similarity of the image embedding and the prompt's text embedding"
OPEN_CLIP_VOCAB = 49408


def _is_open_clip(model: nn.Module) -> bool:
    return type(model).__module__.startswith("open_clip.")


def has_text_tower(m: LoadedModel) -> bool:
    """Whether the model has a text tower vitlens can score prompts with (CLIP / SigLIP, open_clip or HF)."""
    model = m.model
    if _is_open_clip(model):
        return callable(getattr(model, "encode_text", None)) and (
            hasattr(model, "text") or hasattr(model, "token_embedding"))
    return callable(getattr(model, "get_text_features", None)) and getattr(model, "text_model", None) is not None


def is_text_target(target: Any) -> bool:
    """A prompt, a list of prompts, or pre-tokenised ids (a mapping with ``input_ids``)."""
    if isinstance(target, str) or isinstance(target, Mapping):
        return True
    return isinstance(target, (list, tuple)) and len(target) > 0 and all(isinstance(t, str) for t in target)


def _is_siglip(model: nn.Module) -> bool:
    if _is_open_clip(model):
        return getattr(model, "logit_bias", None) is not None
    return "Siglip" in type(model).__name__


def _vocab_size(model: nn.Module) -> int | None:
    if _is_open_clip(model):
        v = getattr(model, "vocab_size", None)
        if v is None:
            emb = getattr(getattr(model, "text", None), "token_embedding", None)
            v = getattr(emb, "num_embeddings", None)
        return int(v) if v is not None else None
    cfg = getattr(getattr(model, "config", None), "text_config", None)
    return int(cfg.vocab_size) if cfg is not None and getattr(cfg, "vocab_size", None) else None


def _no_tokenizer(m: LoadedModel, why: str) -> InvalidParameterError:
    return InvalidParameterError(
        f"{m.spec.name} has a text tower but {why}, so the prompt cannot be tokenised.",
        fixes={"python": "Pass tokenizer= to vl.attribute (a Hugging Face tokenizer, or a callable taking a list of "
                         "prompts and returning token ids [P, L]), set m.tokenizer, or pass pre-tokenised ids as the "
                         "target: target={'input_ids': ids [P, L], 'attention_mask': mask}.",
               "app": "Load a checkpoint folder saved with its tokenizer (hf:FOLDER, after "
                      "tokenizer.save_pretrained(FOLDER)), or an open_clip:ARCH name."})


def resolve_tokenizer(m: LoadedModel, tokenizer: Any = None) -> Any:
    """The tokenizer for ``m``'s text tower: ``tokenizer``, else ``m.tokenizer``, else the model's own.

    Raises:
        InvalidParameterError: none is available (a Hugging Face model built from a config, or saved
            without its tokenizer), saying what to pass.
    """
    if tokenizer is not None:
        return tokenizer
    if getattr(m, "tokenizer", None) is not None:
        return m.tokenizer
    model = m.model
    if _is_open_clip(model):
        import open_clip

        arch = m.spec.name.split(":", 1)[1].split("/", 1)[0] if m.spec.name.startswith("open_clip:") else None
        if arch:
            try:
                tok = open_clip.get_tokenizer(arch)
            except Exception as e:  # noqa: BLE001 - e.g. a Hugging Face tokenizer (SigLIP configs) not cached offline
                raise _no_tokenizer(m, f"open_clip.get_tokenizer({arch!r}) failed ({type(e).__name__}: "
                                       f"{str(e).splitlines()[0] if str(e) else ''})") from e
        elif _vocab_size(model) == OPEN_CLIP_VOCAB:
            from open_clip.tokenizer import SimpleTokenizer

            tok = SimpleTokenizer(context_length=int(getattr(model, "context_length", 77) or 77))
        else:
            raise _no_tokenizer(m, f"it was built in code with a {_vocab_size(model)}-token vocabulary (not "
                                   "open_clip's 49,408) and no open_clip architecture name")
        m.tokenizer = tok
        return tok
    source = m.source or ""
    from pathlib import Path

    if source and Path(source).is_dir():
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - any failure means: no tokenizer saved there
            raise _no_tokenizer(m, f"no tokenizer could be read from {source} ({type(e).__name__})") from e
        m.tokenizer = tok
        return tok
    raise _no_tokenizer(m, "no tokenizer comes with it (random init from a config, or a module built in code)")


def _tokenize(m: LoadedModel, prompts: list[str], tokenizer: Any) -> dict[str, torch.Tensor]:
    tok = resolve_tokenizer(m, tokenizer)
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is optional
        PreTrainedTokenizerBase = ()  # type: ignore[assignment, misc]  # no class to test against: isinstance is False
    if isinstance(tok, PreTrainedTokenizerBase):
        if _is_siglip(m.model):  # SigLIP was trained on prompts padded to the full length, no mask
            cfg = m.model.config.text_config
            out = tok(prompts, padding="max_length", max_length=int(cfg.max_position_embeddings), truncation=True,
                      return_tensors="pt")
            out = {"input_ids": out["input_ids"]}  # as SiglipProcessor gives them: the ids alone
        else:
            out = tok(prompts, padding=True, truncation=True, return_tensors="pt")
    elif callable(tok):
        out = tok(prompts)
    else:
        raise InvalidParameterError(f"tokenizer must be callable (prompts -> token ids); got {type(tok).__name__}.")
    return _as_ids(out)


def _as_ids(out: Any) -> dict[str, torch.Tensor]:
    if isinstance(out, Mapping):
        if "input_ids" not in out:
            raise InvalidParameterError("pre-tokenised text must have 'input_ids' [P, L]; got keys "
                                        f"{', '.join(map(str, out))}.")
        ids = {k: torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v)
               for k, v in out.items() if k in ("input_ids", "attention_mask")}
    else:
        ids = {"input_ids": torch.as_tensor(out)}
    ids = {k: (v if v.ndim == 2 else v.reshape(1, -1)).long() for k, v in ids.items()}
    return ids


@torch.no_grad()
def text_embeddings(m: LoadedModel, ids: dict[str, torch.Tensor]) -> torch.Tensor:
    """[P, D] unit text embeddings of token ids (float32, no gradients)."""
    model = m.model
    vocab = _vocab_size(model)
    input_ids = ids["input_ids"].to(m.device)
    if vocab is not None and (int(input_ids.max()) >= vocab or int(input_ids.min()) < 0):
        raise InvalidParameterError(
            f"the token ids run over [{int(input_ids.min())}, {int(input_ids.max())}], outside {m.spec.name}'s "
            f"text vocabulary of {vocab}: the tokenizer does not fit this model; pass tokenizer= (or ids) that do.")
    with m.autocast():
        if _is_open_clip(model):
            out = model.encode_text(input_ids)
        else:
            mask = ids.get("attention_mask")
            out = model.get_text_features(input_ids=input_ids,
                                          attention_mask=None if mask is None else mask.to(m.device))
            out = out if isinstance(out, torch.Tensor) else out.pooler_output
    return torch.nn.functional.normalize(out.float(), dim=-1)


class TextTargets:
    """The prompts of one ``attribute`` call: distinct prompts, each image's index, their unit embeddings."""

    def __init__(self, m: LoadedModel, target: Any, n_images: int | None, tokenizer: Any = None) -> None:
        if not has_text_tower(m):
            raise InvalidParameterError(
                f"{m.spec.name} has no text tower, so a text target cannot be scored; text targets work with "
                "OpenCLIP CLIP models and Hugging Face CLIPModel / SiglipModel (give a class index here).")
        if isinstance(target, Mapping):
            ids = _as_ids(target)
            rows = int(ids["input_ids"].shape[0])
            self.names = [f"token ids {i}" for i in range(rows)]
            self.index = None if rows == 1 else np.arange(rows)
            self._ids: dict[str, torch.Tensor] | None = ids
        else:
            prompts = [target] if isinstance(target, str) else [str(t) for t in target]
            if any(not p.strip() for p in prompts):
                raise InvalidParameterError("a text target must be a non-empty prompt.")
            self.names = list(dict.fromkeys(prompts))
            self.index = None if len(prompts) == 1 else np.array([self.names.index(p) for p in prompts])
            self._ids = None
        if self.index is not None and n_images is not None and len(self.index) != n_images:
            raise InvalidParameterError(f"a text target is one prompt for all images or one per image; got "
                                        f"{len(self.index)} for {n_images} images.")
        ids = self._ids if self._ids is not None else _tokenize(m, self.names, tokenizer)
        self.embeddings = text_embeddings(m, ids)

    def batch(self, start: int, size: int, device: torch.device) -> torch.Tensor:
        """Each image's prompt index for images ``start`` .. ``start + size``."""
        if self.index is None:
            return torch.zeros(size, dtype=torch.long, device=device)
        if start + size > len(self.index):
            raise InvalidParameterError(f"a text target is one prompt for all images or one per image; got "
                                        f"{len(self.index)} prompts for more images.")
        return torch.as_tensor(self.index[start:start + size], dtype=torch.long, device=device)

    def scorer(self, m: LoadedModel) -> "PromptScore":
        """x -> [B, P]: each image's cosine similarity to every prompt (graph kept for gradients)."""
        return PromptScore(m, self.embeddings)


class PromptScore:
    """x -> [B, P]: each image's cosine similarity to every prompt; ``directions`` [P, D] the prompts' unit
    embeddings, for a method that reads the similarity along them (the spatial decomposition)."""

    def __init__(self, m: LoadedModel, directions: torch.Tensor) -> None:
        self.m, self.directions = m, directions

    def __call__(self, inp: torch.Tensor) -> torch.Tensor:
        image = torch.nn.functional.normalize(self.m.forward(inp).float(), dim=-1)
        return image @ self.directions.to(image.device).T


__all__ = ["SCORE", "PromptScore", "TextTargets", "has_text_tower", "is_text_target", "resolve_tokenizer",
           "text_embeddings"]
