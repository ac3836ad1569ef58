"""vitlens: the interpretability views of the ViT paper (Dosovitskiy et al., ICLR 2021, section 4.5)
for any timm Vision Transformer.

    import vitlens as vl
    m = vl.load_model("ref-vit")
    r = vl.analyze(m, vl.sample_images())

The package, by what each part is:

- ``core``: ``ModelSpec`` and the attention and filter maths every family shares (imports nothing of vitlens);
- ``loading``: names to models (embedded pair, timm hub, checkpoints, user modules);
- ``families``: how each kind of ViT is read exactly (spec, attention capture, filters, E_pos);
- ``engine``: the one forward per batch every attention view rides on (exact capture, the plan, the batch source
  of each kind of input: images or a video model's clips, the consumer protocol);
- ``views``: the paper's four views (and the relative-position bias, Fig. 7 centre's analogue), one image's
  attention maps, the views of a video model's clips;
- ``attribution``: class-specific attributions, faithfulness, mask metrics;
- ``compare``: layer-by-layer CKA between models, head importance;
- ``components``: the output as an exact sum over embeddings, heads x tokens, MLPs and biases (with a ledger);
- ``sae``: sparse autoencoders of a residual-stream site trained as the images stream, measured, saved and loaded;
  linear probes per block;
- ``reference``: the embedded reference pair (scenes, models, training, weights);
- ``survey``: a model zoo x an image set on Ray, resumable, one tidy table;
- ``report``: the command line and its offline HTML pages;
- ``clips``: reading, sampling and writing clips for the video models;
- ``kinds`` and ``registry``: the kinds of model, and every registry (kinds, views, methods, metrics, families) with
  the one way to add to each;
- ``figures``, ``results``, ``images``, ``progress``, ``errors``: shared pieces.

The top level holds the verbs and the few types a user names (``__all__``); result classes, accumulators and the
registries live in their modules. A name that was public here before (issue 61) still resolves, with one
``FutureWarning`` naming its module.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import exported_names, lazy_names
from ._version import __version__

if TYPE_CHECKING:  # the public names, imported on first use (``_lazy``): ``import vitlens`` does not import torch
    from .attribution import (attribute, compare_methods, deletion_insertion, perturbation_test, road, sanity_check,
                              sanity_table)
    from .clips import Clip, clip_pixel_values, moving_shape_clip, read_clip, write_gif, write_mp4
    from .compare import cka, head_importance
    from .components import decompose, logit_lens, mean_ablate, patch_activations, text_span, token_norms
    from .engine import AttentionConsumer, BatchInfo, stream_attention
    from .engine.capture import capture_attention
    from .errors import (CheckpointError, ClipLoadError, ImageLoadError, InvalidParameterError, UnknownModelError,
                         UnsupportedModelError, ViewNotAvailableError, VitlensError)
    from .images import Images, preprocess, sample_images, to_rgb
    from .kinds import kind_of
    from .loading import LoadedModel, ModelSpec, list_models, load_model
    from .results import Result, load_result
    from .sae import evaluate_sae, linear_probes, load_sae, train_sae
    from .sae.features import sae_features
    from .sae.interventions import sae_intervene
    from .survey import load_survey, survey
    from .views.analyze import analyze, attention_distance, attention_rollout
    from .views.attention_maps import attention_maps, query_token
    from .views.filters import embedding_filter_pca
    from .views.packed import analyze_each
    from .views.position import position_similarity
    from .views.prefix import prefix_diagnostics
    from .views.registry import available_views
    from .views.relpos import relative_position_bias
    from .views.rollout import rollout_sources
    from .views.video_weights import video_filter_pca, video_position_similarity

#: names that were public here before the top level was narrowed (issue 61), by the module that holds each now: each
#: still resolves, with one ``FutureWarning`` that names its module (``_lazy.lazy_names``)
MOVED: dict[str, str] = {
    **dict.fromkeys(("AttributionResult", "ComparisonTable", "FaithfulnessResult", "SanityResult"), ".attribution"),
    "ATTRIBUTION_METHODS": ".attribution",
    **dict.fromkeys(("CKAResult", "HeadImportanceResult"), ".compare"),
    **dict.fromkeys(("DecompositionResult", "LogitLensResult", "MeanAblationResult", "PatchingResult",
                     "TextSpanResult", "TokenNormsResult"), ".components"),
    "MovingShape": ".clips",
    **dict.fromkeys(("AttentionCapture", "attention_probs"), ".engine.capture"),
    **dict.fromkeys(("DeviceUnavailableError", "WeightsUnavailableError"), ".errors"),
    **dict.fromkeys(("Kind", "all_kinds", "register_kind", "registered_kind"), ".registry"),
    "PRESETS": ".loading",
    **dict.fromkeys(("ComparisonData", "ReportData"), ".report.data"),
    "SurveyResult": ".survey",
    "AnalysisResult": ".views.analyze",
    "AttentionMapsResult": ".views.attention_maps",
    **dict.fromkeys(("ClassAttentionDistanceAccumulator", "ClassAttentionDistanceResult",
                     "ClassAttentionRolloutAccumulator"), ".views.class_attention"),
    **dict.fromkeys(("AttentionDistanceAccumulator", "AttentionDistanceResult"), ".views.distance"),
    "FilterPCAResult": ".views.filters",
    "PositionSimilarityResult": ".views.position",
    **dict.fromkeys(("PrefixAttentionAccumulator", "PrefixDiagnosticsResult"), ".views.prefix"),
    "RelativePositionBiasResult": ".views.relpos",
    **dict.fromkeys(("RolloutAccumulator", "RolloutResult"), ".views.rollout"),
    **dict.fromkeys(("SpaceTimeDistanceResult", "SpaceTimeRolloutResult"), ".views.spacetime"),
    **dict.fromkeys(("TubeletFilterPCAResult", "VideoPositionSimilarityResult"), ".views.video_weights"),
    **dict.fromkeys(("WindowedDistanceAccumulator", "WindowedDistanceResult"), ".views.windowed"),
    "WindowedRolloutAccumulator": ".views.windowed_rollout",
}
#: a moved name read under another name in its module (the methods registered when read; also
#: ``vitlens.registry.attribution_methods()``)
RENAMED: dict[str, str] = {"ATTRIBUTION_METHODS": "METHODS"}

__getattr__, __dir__ = lazy_names(__name__, __file__, globals(), MOVED, RENAMED)
__all__ = exported_names(__file__)
