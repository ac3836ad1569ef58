"""The command line's parser: its five commands and their options, an error as one line with exit code 2, and the
choices and help read from the registries (methods, metrics, survey views) only when an option is given or help is
shown, so parsing imports nothing heavy."""
from __future__ import annotations

import argparse
from typing import Callable, Iterator, NoReturn, Sequence

from .common import ALL_METHODS, EXIT_USAGE
from .report import cmd_compare, cmd_models, cmd_report
from .survey import cmd_survey, cmd_survey_report


def _common(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--images", help="folder, glob pattern or file of images")
    src.add_argument("--samples", action="store_true", help="scikit-image's sample photographs")
    src.add_argument("--shapes", action="store_true", help="held-out vitlens shapes scenes (the default)")
    src.add_argument("--video", default=None, metavar="CLIP", help="a clip for video models: a video file, an "
                     "animated GIF or a folder of frames, sampled as each model's processor samples it")
    p.add_argument("--fps", type=_positive_float, default=None,
                   help="the clip's frame rate, where the file does not give it (temporal distances in seconds)")
    p.add_argument("--n-images", type=_positive, default=128, help="use at most this many images (default 128)")
    p.add_argument("--batch-size", type=_positive, default=32,
                   help="images per forward (default 32; lower it when memory runs short)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--arch", default=None, help="architecture of a local checkpoint file (timm name or ref-vit)")
    p.add_argument("--random-init", action="store_true",
                   help="random weights instead of pretrained hub weights (timm names; embedded models keep theirs)")
    p.add_argument("--seed", type=int, default=0, help="seed for random-init weights (default 0)")
    p.add_argument("--data", default=None, help="where to write the numbers (default: OUT with .json)")
    p.add_argument("--png", default=None, metavar="DIR", help="also write static PNGs of every figure (kaleido)")
    p.add_argument("--strict", action="store_true", help="stop on unreadable images instead of skipping them")
    p.add_argument("--quiet", action="store_true", help="no progress or messages on stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


class Parser(argparse.ArgumentParser):
    """argparse with the command line's rules: an error is one line on stderr and exit code 2 (no usage block;
    the line says where the usage is), and an option's help that reads a registry (``later_help``) is written only
    when help is shown, so that parsing imports nothing heavy. Its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        for action in self._actions:
            later = getattr(action, "later_help", None)
            if later is not None:
                action.help = later()
        return super().format_help()


def later_help(action: argparse.Action, write: Callable[[], str]) -> None:
    """Give ``action`` help that ``write`` composes when help is shown (``Parser.format_help``), not when parsed."""
    # argparse's Action declares no such attribute: Parser.format_help reads it back by getattr
    action.later_help = write  # type: ignore[attr-defined]


class Names:
    """The choices of an option read from a registry at their first use: argparse asks ``in`` (and lists them in an
    error) only when the option is given, so the registry's module (and torch) is imported only then."""

    def __init__(self, read: Callable[[], Sequence[str]]) -> None:
        self._read = read

    def __contains__(self, name: object) -> bool:
        return name in self._read()

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())


def _methods() -> list[str]:
    from vitlens.attribution.methods import METHOD_TABLE

    return [*METHOD_TABLE, ALL_METHODS]


def _metrics() -> list[str]:
    from vitlens.attribution.metrics import METRIC_TABLE

    return list(METRIC_TABLE)


def _survey_views() -> list[str]:
    from vitlens.survey.stats import SURVEY_VIEW_NAMES

    return list(SURVEY_VIEW_NAMES)


def _default_survey_views() -> list[str]:
    from vitlens.survey.stats import DEFAULT_SURVEY_VIEW_NAMES

    return list(DEFAULT_SURVEY_VIEW_NAMES)


def _methods_help() -> str:
    from vitlens.attribution.methods import METHOD_TABLE, methods_for
    from vitlens.kinds import HIERARCHICAL

    return ("attribution methods for --attributions (default: the quick set, "
            f"{', '.join(k for k, mt in METHOD_TABLE.items() if mt.preselected)}; "
            f"'{ALL_METHODS}' for every available one, the slow ones included; each model gets those "
            f"defined for its kind, a hierarchical one (Swin) {', '.join(methods_for(HIERARCHICAL.name))}): "
            + ", ".join(METHOD_TABLE))


def _metrics_help() -> str:
    from vitlens.attribution.metrics import METRIC_TABLE

    return ("perturbation metrics for --attributions (default: "
            f"{', '.join(k for k, mt in METRIC_TABLE.items() if mt.default)}): "
            + "; ".join(f"{k} ({mt.cost})" if mt.cost else k for k, mt in METRIC_TABLE.items()))


def _local_threshold_help() -> str:
    from vitlens.views.distance import LOCAL_OF_UNIFORM

    return ("a head is local at or below this multiple of the uniform-attention distance on its grid (default "
            f"{LOCAL_OF_UNIFORM:g}, the one definition every view uses)")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> Parser:
    """The command line's parser; building it and parsing valid or invalid arguments import no analysis module."""
    p = Parser(prog="vitlens", description="Interpretability reports for Vision Transformers.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="every view for one or more models (Fig. 6, 7)")
    r.add_argument("--model", action="append", default=None, help="model name or checkpoint (repeatable; "
                   "default ref-vit)")
    r.add_argument("--out", default="report.html", metavar="FILE",
                   help="the HTML report to write (default report.html; the numbers go beside it as .json)")
    r.add_argument("--attributions", action="store_true",
                   help="add class-specific attributions (captum, grad-rollout) and their faithfulness scores")
    later_help(r.add_argument("--methods", nargs="+", default=None, choices=Names(_methods), metavar="METHOD",
                              help="attribution methods for --attributions"), _methods_help)
    later_help(r.add_argument("--metrics", nargs="+", default=None, choices=Names(_metrics), metavar="METRIC",
                              help="perturbation metrics for --attributions"), _metrics_help)
    r.add_argument("--attribution-images", type=_positive, default=16,
                   help="images for the attribution section (default 16; occlusion and IG are costly)")
    r.add_argument("--heads", action="store_true",
                   help="add head importance (one head removed at a time) against attention distance")
    r.add_argument("--head-images", type=_positive, default=32,
                   help="images for head importance (default 32; it costs one forward per head and image)")
    r.add_argument("--components", action="store_true",
                   help="add the components: each head's part of the predicted class's logit with the ledger that "
                        "closes the sum, the logit lens and token norms by depth")
    r.add_argument("--component-images", type=_positive, default=4,
                   help="images for the components section (default 4)")
    r.add_argument("--sae", default=None, metavar="PATH",
                   help="add an SAE section: the features of this sparse autoencoder (a vitlens SAE folder, a SAELens "
                        "/ ViT-Prisma folder or a saev checkpoint) over the report's images, their writers and an "
                        "ablation")
    r.add_argument("--train-sae", action="store_true",
                   help="add an SAE section with an SAE trained on the report's images (--sae-site, --sae-features, "
                        "--sae-k, --sae-epochs)")
    r.add_argument("--sae-site", default=None, metavar="SITE",
                   help="the site --train-sae reads (default the middle block's output, blocks.L/2.hook_resid_post)")
    r.add_argument("--sae-features", type=_positive, default=256, help="--train-sae's dictionary size (default 256)")
    r.add_argument("--sae-k", type=_positive, default=8, help="--train-sae's active features per token (default 8)")
    r.add_argument("--sae-epochs", type=_positive, default=3, help="--train-sae's passes over the images (default 3)")
    r.set_defaults(func=cmd_report)
    _common(r)
    c = sub.add_parser("compare", help="attention distance of several models in one chart (Fig. 11)")
    c.add_argument("--models", nargs="+", default=["ref-vit", "ref-hybrid"], metavar="MODEL",
                   help="the models to compare: names, hf:FOLDER or checkpoint files as --model takes them "
                        "(default ref-vit ref-hybrid)")
    c.add_argument("--out", default="compare.html", metavar="FILE",
                   help="the HTML comparison to write (default compare.html; the numbers go beside it as .json)")
    later_help(c.add_argument("--local-threshold", type=float, default=None,
                              help="a head is local at or below this multiple of the uniform-attention distance"),
               _local_threshold_help)
    c.add_argument("--first-layers", type=_positive, default=4, help="layers counted for the local share")
    c.add_argument("--cka", action="store_true",
                   help="add layer-by-layer representation similarity (linear CKA) of each model with the first")
    c.set_defaults(func=cmd_compare)
    _common(c)
    ls = sub.add_parser("models", help="list the presets and the model families vitlens reads")
    ls.set_defaults(func=cmd_models, debug=False)
    sv = sub.add_parser("survey", help="a model zoo x an image set on Ray: resumable, one tidy table (Fig. 11 "
                                       "across a zoo)")
    sv.add_argument("--models", nargs="+", default=None,
                    help="model names, or local checkpoints as PATH@ARCH (runs/e3.safetensors@vit_tiny_patch16_224)")
    sv.add_argument("--models-file", default=None,
                    help="a file with one model name or PATH@ARCH per line (# comments)")
    sv.add_argument("--images", default=None, help="folder (searched recursively) or glob of images; default: "
                                                   "held-out shapes scenes")
    sv.add_argument("--per-class", action="store_true", help="each image's parent folder is its class")
    sv.add_argument("--clips", default=None, help="a folder of clips (videos, animated GIFs; searched recursively) "
                                                  "for video models: shards of clips, the space-time statistics")
    sv.add_argument("--out", required=True, help="the survey folder (a rerun continues it)")
    sv.add_argument("--address", default=None, help="a Ray cluster ('auto', 'ray://host:10001'); default: "
                                                    "RAY_ADDRESS, else a local Ray on this machine's cores")
    sv.add_argument("--batch-size", type=_positive, default=32,
                    help="images per forward on each worker (default 32)")
    sv.add_argument("--shard-size", type=_positive, default=256, help="images per task (default 256)")
    later_help(sv.add_argument("--views", nargs="+", default=None, choices=Names(_survey_views), metavar="VIEW",
                               help="the views to survey"),
               lambda: f"the views to survey: {', '.join(_survey_views())} (default "
                       f"{', '.join(_default_survey_views())})")
    sv.add_argument("--num-gpus-per-worker", type=float, default=0.0,
                    help="GPUs each model worker asks Ray for (default 0: CPU; a worker with a GPU runs on it)")
    sv.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="where the model workers run, as for report and compare: cuda asks Ray for one GPU per "
                         "worker (--num-gpus-per-worker 1), cpu for none (default: --num-gpus-per-worker)")
    weights = sv.add_mutually_exclusive_group()
    weights.add_argument("--pretrained", dest="pretrained", action="store_true", default=True,
                         help="hub weights (the default)")
    weights.add_argument("--random-init", dest="pretrained", action="store_false",
                         help="random weights for hub models (seeded); the embedded models and PATH@ARCH checkpoints "
                              "keep their own weights, which the run says")
    sv.add_argument("--n-images", type=_positive, default=None, help="use at most this many images (default: "
                                                                     "every file; 128 shapes scenes)")
    sv.add_argument("--max-images", dest="n_images", type=_positive, default=None, help=argparse.SUPPRESS)
    sv.add_argument("--strict", action="store_true", help="stop at the first model that fails")
    sv.add_argument("--quiet", action="store_true", help="no progress or messages on stderr")
    sv.add_argument("--debug", action="store_true", help="show tracebacks")
    sv.set_defaults(func=cmd_survey)
    sr = sub.add_parser("survey-report", help="one offline HTML page of a survey folder")
    sr.add_argument("folder", help="the survey folder that vitlens survey --out wrote")
    sr.add_argument("--out", default="survey.html", metavar="FILE", help="the HTML page to write (default survey.html)")
    sr.add_argument("--png", default=None, metavar="DIR", help="also write the figures as PNGs (kaleido)")
    sr.add_argument("--quiet", action="store_true", help="no progress or messages on stderr")
    sr.add_argument("--debug", action="store_true", help="show tracebacks")
    sr.set_defaults(func=cmd_survey_report)
    return p


__all__ = ["Names", "Parser", "build_parser", "later_help"]
