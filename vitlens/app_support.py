"""What the Streamlit app shows beyond the four views, as plain functions the app composes and
the tests check: model facts, top-5 predictions, one query's attention (paper Fig. 6 detail),
all heads of a layer, CSV/JSON exports and figure downloads."""
from __future__ import annotations

import csv
import io
import json
from typing import Any

import numpy as np
import plotly.graph_objects as go
import torch

from .errors import InvalidParameterError
from .figures import overlay_grid_figure
from .model import LoadedModel, param_count_str
from .results import Result
from .views.distance import AttentionDistanceResult
from .views.filters import FilterPCAResult
from .views.position import PositionSimilarityResult
from .views.rollout import RolloutResult


def model_facts(m: LoadedModel) -> dict[str, str]:
    """The spec in words, for the sidebar and report headers."""
    s = m.spec
    prefix = []
    if s.has_class_token:
        prefix.append("class")
    extra = s.num_prefix_tokens - len(prefix)
    if extra:
        prefix.append(f"{extra} more (distillation/register)")
    return {
        "kind": "hybrid (CNN + ViT)" if s.kind == "hybrid" else "ViT",
        "input": f"{s.image_size[0]}x{s.image_size[1]} px",
        "grid": f"{s.grid[0]}x{s.grid[1]} tokens",
        "stride": f"{s.stride_px[0]}x{s.stride_px[1]} px" if s.stride_px[0] != s.stride_px[1] else f"{s.stride_px[0]} px",
        "prefix tokens": f"{s.num_prefix_tokens} ({', '.join(prefix) or 'none: GAP/MAP head'})",
        "layers x heads": f"{s.num_layers} x {s.num_heads}",
        "width": str(s.embed_dim),
        "parameters": param_count_str(s.num_params),
        "classes": str(s.num_classes) if s.num_classes else "none (feature model)",
        "device": f"{m.device} ({str(m.dtype).replace('torch.', '')})",
    }


def top_predictions(m: LoadedModel, x: torch.Tensor, k: int = 5) -> list[tuple[str, float]]:
    """Top-k (label, probability) of one preprocessed image [1, 3, H, W]; [] without a classifier."""
    if m.spec.num_classes <= 0:
        return []
    probs = m.logits(x[:1]).softmax(-1)[0]
    values, idx = probs.topk(min(k, probs.numel()))
    names = m.label_names()
    return [(names[i] if names else f"class {i}", float(v)) for v, i in zip(values.tolist(), idx.tolist())]


def query_attention(maps: np.ndarray, num_prefix_tokens: int, grid: tuple[int, int], query: int) -> np.ndarray:
    """Attention of token ``query`` over patch keys: [heads, T, T] -> [heads, gh, gw].

    Args:
        maps: one block's attention of one image.
        num_prefix_tokens: prefix tokens (the class token is token 0 when present).
        grid: (gh, gw).
        query: token index (0 for the class token, ``prefix + r * gw + c`` for patch (r, c)).
    """
    t = maps.shape[-1]
    if not 0 <= query < t:
        raise InvalidParameterError(f"query must be a token index in [0, {t}); got {query}.")
    return maps[:, query, num_prefix_tokens:].reshape(maps.shape[0], *grid)


def heads_figure(image: np.ndarray, head_maps: np.ndarray, layer: int, query_label: str,
                 opacity: float = 0.5) -> go.Figure:
    """All heads of one layer as small multiples: where ``query_label`` attends, per head."""
    panels = [(image, hm / max(float(hm.max()), 1e-12), f"head {h + 1}") for h, hm in enumerate(head_maps)]
    return overlay_grid_figure(panels, f"Layer {layer + 1}: attention of {query_label} (each head scaled to its max)",
                               opacity, columns=min(6, len(panels)))


def result_rows(result: Result) -> list[dict[str, Any]]:
    """A result as flat rows for CSV."""
    if isinstance(result, AttentionDistanceResult):
        return [{"layer": layer + 1, "head": head + 1, "mean_px": float(result.mean_px[layer, head]),
                 "std_px": float(result.std_px[layer, head]), "n_images": result.n_images}
                for layer in range(result.mean_px.shape[0]) for head in range(result.mean_px.shape[1])]
    if isinstance(result, FilterPCAResult):
        return [{"component": i + 1, "explained_variance_ratio": float(v)}
                for i, v in enumerate(result.explained_variance_ratio)]
    if isinstance(result, PositionSimilarityResult):
        gh, gw = result.grid
        s = result.similarity
        return [{"row": r, "col": c, "row2": r2, "col2": c2, "cosine": float(s[r, c, r2, c2])}
                for r in range(gh) for c in range(gw) for r2 in range(gh) for c2 in range(gw)]
    if isinstance(result, RolloutResult):
        return [{"image": i, "row": r, "col": c, "rollout": float(result.maps[i, r, c])}
                for i in range(result.maps.shape[0]) for r in range(result.maps.shape[1])
                for c in range(result.maps.shape[2])]
    raise InvalidParameterError(f"No CSV layout for {type(result).__name__}.")


def to_csv(result: Result) -> bytes:
    return rows_to_csv(result_rows(result))


def rows_to_csv(rows: list[dict[str, Any]]) -> bytes:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue().encode()


def to_json(result: Result) -> bytes:
    return result.to_json().encode()


def read_upload(name: str, data: bytes, max_bytes: int) -> Any:
    """An uploaded file as an RGB PIL image, refusing files over ``max_bytes``."""
    from .errors import ImageLoadError
    from .images import open_image, to_rgb

    if len(data) > max_bytes:
        raise ImageLoadError(f"{name} is {len(data) / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB. "
                             "Downscale it and upload again.")
    return to_rgb(open_image(io.BytesIO(data), name), what=name)


def json_dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=2).encode()
