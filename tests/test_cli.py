"""The command line as a user runs it (subprocesses): reports and comparisons that open offline
in a real browser, data that loads back into equal result objects, and one-line errors."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vitlens as vl
from vitlens.registry import attribution_methods
from vitlens.reference.shapes import HELD_OUT_SEED, generate
from vitlens.views.registry import VIEW_NAMES, VIEWS

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# CI installs Chromium (.ci/run), so there a missing browser fails instead of skipping
NO_BROWSER = CHROMIUM is None and not os.environ.get("CI")


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}  # OMP_NUM_THREADS: tests/conftest.py
    return subprocess.run([sys.executable, "-m", "vitlens", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd or ROOT, env=env)


def run_cli_here(*args: str) -> subprocess.CompletedProcess:
    """The same command through ``vitlens.cli.main`` in this process (its exit status, what it printed),
    so that each test does not pay a fresh interpreter's imports (~4-9 s): what the command does is the same code
    either way. Real processes are kept where the process is the point: the report and comparison of the embedded
    pair (``pair_report``, ``pair_compare``: end to end, opened in a browser), ``python -m vitlens`` refusing a bad
    number before torch is imported, ``--debug``'s traceback, and ``test_same_command_gives_the_same_numbers`` (a
    fresh process against this one)."""
    import contextlib
    import io

    from vitlens.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(["vitlens", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def pair_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "pair.html"
    proc = run_cli("report", "--model", "ref-vit", "--model", "ref-hybrid", "--n-images", "12", "--batch-size", "8",
                   "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    return out


def test_report_data_round_trips_into_results_equal_to_a_library_call(pair_report):
    data = vl.load_result(pair_report.with_suffix(".json"))
    assert data.models == ["ref-vit", "ref-hybrid"] and data.image_set["count"] == 12
    images = list(generate(12, seed=HELD_OUT_SEED).images)
    for name, got in zip(data.models, data.analyses):
        m = vl.load_model(name, device="cpu")
        views = vl.available_views(m)  # every view the registry defines for images (the video views read clips)
        want = vl.analyze(m, images, batch_size=8, views=views)
        assert views == tuple(v for v in VIEW_NAMES if not VIEWS[v].for_kind) and got.views == views
        assert "no learned relative-position bias" in got.notes["relpos"]
        assert got.equals(want, rtol=1e-12), name


def test_report_html_is_self_contained_with_plotly_inlined_once(pair_report):
    text = pair_report.read_text()
    assert text.count("plotly.js v") == 1  # the library's banner: one copy of plotly.js
    # plotly.js itself mentions its CDN (topojson for geo plots, unused here); nothing is loaded from it
    assert "<script src=" not in text and 'src="http' not in text
    assert "ref-hybrid" in text and "first convolution" in text


@pytest.mark.skipif(NO_BROWSER, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_report_opens_offline_in_headless_chromium_with_every_figure_drawn(pair_report, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(pair_report.as_uri())
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 10", timeout=30000)
        plots = page.locator(".js-plotly-plot")
        n_plots = plots.count()
        drawn = [plots.nth(i).locator(".main-svg").count() > 0 for i in range(n_plots)]
        page.screenshot(path=str(tmp_path / "report.png"))
        browser.close()
    assert n_plots == 10  # 5 figures for each of the two models (the four views, attention on prefix tokens)
    assert all(drawn)
    assert errors == []
    assert [u for u in requests if not u.startswith(("file:", "data:", "blob:"))] == []


@pytest.fixture(scope="module")
def pair_compare(tmp_path_factory) -> Path:
    """``vitlens compare`` of the embedded pair over 8 images, with CKA: one process for the tests of the page
    and of its CKA section."""
    out = tmp_path_factory.mktemp("compare") / "cmp.html"
    proc = run_cli("compare", "--n-images", "8", "--cka", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    return out


def test_compare_of_the_embedded_pair_writes_table_and_local_share(pair_compare):
    out = pair_compare
    data = vl.load_result(out.with_suffix(".json"))
    assert data.models == ["ref-vit", "ref-hybrid"] and data.units == "px"
    assert len(data.table) == 2 * 6 and set(data.table[0]) == {"model", "layer", "min", "median", "max"}
    assert all(0.0 <= s <= 1.0 for s in data.local_share)
    row = data.table[0]
    assert row["min"] == pytest.approx(float(data.distances[0].mean_px[0].min()))
    assert "Share of local heads" in out.read_text()
    # the embedded pair trained alike shows Fig. 11 (MODEL_CARD.md): the page says so in one line
    import html

    assert data.reading().startswith("Fig. 11's contrast: ref-hybrid") and data.reading() in html.unescape(out.read_text())
    assert data.kinds == ["vit", "hybrid"] and "at most 0.6x the uniform-attention distance" in out.read_text()


def test_compare_of_two_plain_vits_never_names_a_cnn_stem(tmp_path):
    """Issue 29: the embedded ViT against a random-init plain ViT read as "as when a CNN stem has already done
    the local work"."""
    out = tmp_path / "cmp.html"
    proc = run_cli_here("compare", "--models", "ref-vit", "vit_tiny_patch16_224", "--random-init", "--n-images", "4",
                        "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    data = vl.load_result(out.with_suffix(".json"))
    assert data.kinds == ["vit", "vit"] and data.weights == ["embedded", "random init"]
    said = proc.stdout + proc.stderr
    assert "CNN stem" not in said and "CNN stem" not in out.read_text()
    assert "random weights" in data.reading() or data.reading().startswith("Flat"), data.reading()
    assert "Local heads (at most 0.6x the uniform-attention distance) in layers 1-4" in said


def test_compare_of_different_input_sizes_uses_image_widths(tmp_path):
    out = tmp_path / "cmp.html"
    proc = run_cli_here("compare", "--models", "ref-vit", "vit_tiny_patch16_224", "--random-init", "--n-images", "2",
                        "--samples", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    data = vl.load_result(out.with_suffix(".json"))
    assert data.units == "width" and data.weights == ["embedded", "random init"]
    assert "units of the image width" in out.read_text()
    # the one-line reading speaks of the models compared: not of "the embedded pair" when one has random weights
    assert "embedded pair" not in data.reading()
    if data.reading().startswith("Flat"):
        assert "vit_tiny_patch16_224 has random weights" in data.reading()


@pytest.mark.heavy  # conftest.HEAVY: handed out before the short tests
def test_same_command_gives_the_same_numbers(tmp_path):
    a, b = tmp_path / "a.html", tmp_path / "b.html"
    for out, run in ((a, run_cli), (b, run_cli_here)):  # a fresh process, then this one
        proc = run("report", "--model", "vit_tiny_patch16_224", "--random-init", "--samples", "--n-images", "2",
                   "--out", str(out), "--quiet")
        assert proc.returncode == 0, proc.stderr
    ra, rb = vl.load_result(a.with_suffix(".json")), vl.load_result(b.with_suffix(".json"))
    assert ra.analyses[0].equals(rb.analyses[0])


def test_every_skipped_image_says_why_even_when_none_is_left(tmp_path, monkeypatch):
    """Issue 29: a 14000x14000 PNG was "unreadable" and then "None of the images could be read": the library's
    own reason (too large, downscale it first) reaches the command line. The library's refusal is stood in
    for here (its own pixel budget is tested in test_images.py), so no 588 MB image is made."""
    import vitlens.images

    folder = tmp_path / "giant"
    folder.mkdir()
    vl.sample_images(["coffee"])[0].save(folder / "giant.png")
    Image = __import__("PIL.Image", fromlist=["Image"])
    Image.new("RGB", (1, 1)).save(folder / "dot.png")
    real = vitlens.images.to_rgb

    def refuse_giant(img, what=None):
        if str(img).endswith("giant.png"):
            raise vl.ImageLoadError("giant.png: image too large to analyse safely (a stand-in). Downscale it first.")
        return real(img, what)

    monkeypatch.setattr(vl, "to_rgb", refuse_giant)
    only_giant = tmp_path / "only"
    only_giant.mkdir()
    (folder / "giant.png").rename(only_giant / "giant.png")
    proc = run_cli_here("report", "--model", "ref-vit", "--images", str(only_giant), "--out", str(tmp_path / "g.html"))
    assert proc.returncode == 2 and "could be read: giant.png (giant.png: image too large" in proc.stderr
    assert "Downscale it first" in proc.stderr and not (tmp_path / "g.html").exists()
    # a 1x1 image is analysed, with a word on what that means
    proc = run_cli_here("report", "--model", "ref-vit", "--images", str(folder), "--out", str(tmp_path / "d.html"),
                        "--n-images", "1")
    assert proc.returncode == 0, proc.stderr
    assert "dot.png (1x1 px) is smaller than 16 px: it is enlarged" in proc.stderr


def test_unreadable_images_are_skipped_with_their_names_or_fatal_with_strict(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    vl.sample_images(["coffee"])[0].save(folder / "a.png")
    (folder / "b.jpg").write_bytes(b"not a jpeg")
    out = tmp_path / "r.html"
    proc = run_cli_here("report", "--model", "vit_tiny_patch16_224", "--random-init", "--images", str(folder),
                        "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "warning: skipped b.jpg (Cannot read b.jpg as an image" in proc.stderr and "(s)" not in proc.stderr
    assert vl.load_result(out.with_suffix(".json")).image_set["skipped"] == ["b.jpg"]
    strict = run_cli_here("report", "--model", "vit_tiny_patch16_224", "--random-init", "--images", str(folder),
                          "--strict", "--out", str(tmp_path / "s.html"))
    assert strict.returncode == 2 and "b.jpg" in strict.stderr and not (tmp_path / "s.html").exists()


@pytest.mark.parametrize("args", [
    ["report", "--model", "ref-vit", "--out", "{tmp}/r.html", "--png", "/proc/forbidden"],
    ["report", "--model", "ref-vit", "--out", "/proc/forbidden/r.html"],
    ["report", "--model", "ref-vit", "--out", "{tmp}/r.html", "--data", "/sys/r.json"],
    ["report", "--model", "ref-vit", "--out", "{tmp}/file.txt/r.html"],
    ["compare", "--out", "{tmp}/c.html", "--png", "/proc/forbidden"],
    ["survey", "--models", "ref-vit", "--out", "/proc/forbidden"],
])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, args):
    (tmp_path / "file.txt").write_text("a file, not a folder")
    proc = run_cli_here(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("vitlens: error: --") and "cannot be written" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_models_lists_the_families_and_the_names_each_takes():
    from vitlens.families import FAMILIES, describe_families

    proc = run_cli_here("models")
    assert proc.returncode == 0
    for family in describe_families():
        assert family["name"] in proc.stdout and family["reads"] in proc.stdout
    assert len(describe_families()) == len(FAMILIES) >= 5
    for scheme in ("vit_base_patch16_224", "hf:ORG/NAME", "torchvision:vit_b_16", "--model FILE --arch NAME",
                   "ref-vit, ref-hybrid", "--random-init", "swin_transformer"):
        assert scheme in proc.stdout, scheme


def test_every_command_takes_n_images_and_survey_keeps_max_images_hidden():
    from vitlens.cli import build_parser

    parser = build_parser()
    for command in (["report"], ["compare"], ["survey", "--out", "x"]):
        assert parser.parse_args([*command, "--n-images", "4"]).n_images == 4
    assert parser.parse_args(["survey", "--out", "x", "--max-images", "3"]).n_images == 3  # the older name
    help_text = run_cli_here("survey", "--help").stdout
    assert "--n-images" in help_text and "--max-images" not in help_text


def test_survey_report_of_a_missing_folder_says_it_does_not_exist(tmp_path):
    proc = run_cli_here("survey-report", str(tmp_path / "no_such_zoo"), "--out", str(tmp_path / "s.html"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "not a survey folder" not in proc.stderr
    proc = run_cli_here("survey-report", str(tmp_path), "--out", str(tmp_path / "s.html"))
    assert proc.returncode == 2 and "not a survey folder" in proc.stderr  # it exists, without a manifest


@pytest.mark.parametrize("args,message", [
    (["report", "--model", "vit_base_patch16_22"], "Unknown model"),
    (["report", "--model", "resnet50", "--random-init"], "not a Vision Transformer"),
    (["report", "--model", "vit_tiny_patch16_224.augreg_in21k_ft_in1k"], "could not be downloaded"),
    (["report", "--images", "/no/such/folder"], "not found"),
    (["report", "--images", "/no/such/*.png"], "No files match"),
    (["compare", "--models", "ref-vit"], "at least two models"),
])
def test_bad_input_gives_one_line_and_exit_code_2(tmp_path, args, message):
    proc = run_cli_here(*args, "--out", str(tmp_path / "x.html"))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("vitlens: error:") and message in lines[-1]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x.html").exists()


def test_empty_folder_and_bad_numbers_are_usage_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli_here("report", "--images", str(empty), "--out", str(tmp_path / "x.html"))
    assert proc.returncode == 2 and "holds no images" in proc.stderr
    proc = run_cli_here("report", "--n-images", "0")
    assert proc.returncode == 2 and "must be >= 1" in proc.stderr


#: a bad argument's run in a fresh interpreter: its exit code and whether torch was imported by then
NO_TORCH_YET = """import sys
from vitlens.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(code, 'torch' in sys.modules)
"""


@pytest.mark.parametrize("args,message", [
    (["report", "--n-images", "0"], "vitlens report: error: argument --n-images: must be >= 1, got 0"),
    (["compare", "--first-layers", "x"], "vitlens compare: error: argument --first-layers: must be a whole number"),
    (["survey", "--out", "x", "--bogus"], "vitlens: error: unrecognized arguments: --bogus"),
    (["compare", "--models", "ref-vit"], "vitlens: error: compare needs at least two models"),
    (["survey", "--out", "x"], "vitlens: error: Name the models to survey"),
    (["report", "--out", "."], "vitlens: error: --out . is a folder; give a file name"),
])
def test_a_bad_argument_is_one_line_and_refused_before_torch_is_imported(tmp_path, args, message):
    """Issue 45 item 17: `--n-images 0` printed argparse's 10-line usage before its message, and every error took
    2-9 s because torch was imported before the arguments were checked. Now each is one line, and the process that
    refused it never imported torch (a registry behind a choice is read only when that option is given)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", NO_TORCH_YET, *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)
    assert proc.stdout.split() == ["2", "False"], (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert "usage:" not in proc.stderr


def test_python_m_vitlens_says_a_bad_number_in_one_line_and_help_still_lists_the_registries():
    proc = run_cli("report", "--n-images", "0")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "vitlens report: error: argument --n-images: must be >= 1, got 0 (see vitlens report --help)"]
    from vitlens.attribution.methods import METHOD_TABLE
    from vitlens.attribution.metrics import METRIC_TABLE

    help_text = " ".join(run_cli_here("report", "--help").stdout.split())
    assert all(k in help_text for k in [*METHOD_TABLE, *METRIC_TABLE]) and "the quick set, rollout" in help_text
    wrong = run_cli_here("report", "--attributions", "--methods", "nope")
    assert wrong.returncode == 2 and "invalid choice: 'nope'" in wrong.stderr and "'saliency'" in wrong.stderr
    assert len(wrong.stderr.splitlines()) == 1


@pytest.mark.heavy  # conftest.HEAVY: handed out before the short tests
def test_debug_shows_the_traceback(tmp_path):
    proc = run_cli("report", "--model", "vit_base_patch16_22", "--debug", "--out", str(tmp_path / "x.html"))
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_a_failing_run_leaves_the_previous_report_untouched(tmp_path):
    out = tmp_path / "r.html"
    out.write_text("previous good report")
    out.with_suffix(".json").write_text("{}")
    proc = run_cli_here("report", "--model", "vit_tiny_patch16_224", "--random-init", "--model", "resnet50",
                        "--samples", "--n-images", "1", "--out", str(out))
    assert proc.returncode == 2
    assert out.read_text() == "previous good report" and out.with_suffix(".json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "r.json"]


@pytest.mark.skipif(NO_BROWSER, reason="kaleido needs Chromium")
@pytest.mark.heavy  # conftest.HEAVY: handed out before the short tests
def test_png_export_writes_every_figure(tmp_path):
    proc = run_cli_here("report", "--model", "vit_tiny_patch16_224", "--random-init", "--samples", "--n-images",
                        "1", "--out", str(tmp_path / "r.html"), "--png", str(tmp_path / "png"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert names == [f"1-vit_tiny_patch16_224-{k}.png" for k in ("distance", "filters", "position", "prefix",
                                                                  "rollout")]
    assert all((tmp_path / "png" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)


@pytest.mark.heavy  # conftest.HEAVY: handed out before the short tests
def test_report_with_attributions_scores_every_method(tmp_path):
    out = tmp_path / "attr.html"
    proc = run_cli_here("report", "--model", "ref-vit", "--n-images", "4", "--attributions", "--methods", "all",
                        "--attribution-images", "2", "--out", str(out), "--quiet")  # 2: still a batch
    assert proc.returncode == 0, proc.stderr
    data = vl.load_result(out.with_suffix(".json"))
    table = data.attributions[0]
    assert [r["method"] for r in table.rows] == list(attribution_methods())
    assert table.n_images == 2 and all("pointing_game" in r for r in table.rows)  # shapes come with masks
    page = out.read_text()
    assert "Attributions and faithfulness" in page
    assert "Sanity checks: cascading randomisation" in page and "chefer_positive_auc" in table.rows[0]
    assert [r["method"] for r in table.sanity.to_rows()] == ["rollout", "grad_rollout", "saliency", "input_x_gradient",
                                                             "gradcam"]  # sanity.QUICK_METHODS
    # plotly.js once, and so every image, array and plotly template: the attribution panels all show the
    # same image, which the rollout grid shows too, and plotly writes its template into every figure
    assert page.count("plotly.js v") == 1 and '"template":{' not in page.split("VL_TEMPLATE=", 1)[-1]
    import re

    literals = re.findall(r'"(?:bdata|source)":("(?:[^"\\]|\\.)*")', page)
    big = [v for v in literals if len(v) >= 512]
    assert big and len(big) == len(set(big))
    assert "data:image\\u002fpng;base64," in page  # images as PNG (plotly writes "/" as \u002f), not pixels


@pytest.mark.heavy  # conftest.HEAVY: handed out before the short tests
def test_paper_figure_scripts_run_offline_on_the_embedded_pair(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmp_out = tmp_path / "fig11.html"
    proc = subprocess.run([sys.executable, str(ROOT / "analyses" / "vit_vs_hybrid.py"), "--n-images", "4",
                           "--out", str(cmp_out), "--quiet"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "embedded pair" in proc.stderr
    assert vl.load_result(cmp_out.with_suffix(".json")).models == ["ref-vit", "ref-hybrid"]
    # figure7.py's main in this process: a second interpreter would add its imports (~5 s) and no check (the
    # script's start, its sys.path line, is vit_vs_hybrid.py's above)
    import importlib.util

    spec = importlib.util.spec_from_file_location("figure7_script", ROOT / "analyses" / "figure7.py")
    figure7 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figure7)
    fig7 = tmp_path / "fig7.html"
    assert figure7.main(["--n-images", "4", "--out", str(fig7), "--quiet"]) == 0
    assert vl.load_result(fig7.with_suffix(".json")).models == ["ref-vit"]


@pytest.mark.parametrize("args,message,not_wanted", [
    (["report", "--device", "cuda"], "no usable CUDA GPU", "RuntimeError"),
    (["report", "--model", "ckpt.safetensors"], "Pass --arch with the timm name", "vl.load_model"),
    (["report", "--model", "vit_tiny_patch16_224.augreg_in21k_ft_in1k"], "--random-init", "pretrained=False"),
    (["report", "--model", "vit_tiny_patch16_224.no_such_tag"], "--random-init", "pretrained=False"),
])
def test_errors_give_command_line_hints_in_one_line_with_exit_2(tmp_path, args, message, not_wanted):
    if "ckpt.safetensors" in args:
        from safetensors.torch import save_file
        import torch

        save_file({"x": torch.zeros(1)}, str(tmp_path / "ckpt.safetensors"))
        args = [a if a != "ckpt.safetensors" else str(tmp_path / a) for a in args]
    proc = run_cli_here(*args, "--out", str(tmp_path / "x.html"))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("vitlens: error:") and message in lines[0] and not_wanted not in lines[0]


def test_compare_checks_every_model_before_analysing_the_first(tmp_path):
    proc = run_cli_here("compare", "--models", "ref-vit", "vit_base_patch16_22", "--out", str(tmp_path / "c.html"))
    assert proc.returncode == 2 and "Unknown model 'vit_base_patch16_22'" in proc.stderr
    assert "images in" not in proc.stderr  # nothing was analysed
    assert not (tmp_path / "c.html").exists()


@pytest.mark.skipif(NO_BROWSER, reason="kaleido needs Chromium")
def test_compare_png_writes_every_figure_of_the_page(tmp_path):
    proc = run_cli_here("compare", "--n-images", "2", "--out", str(tmp_path / "c.html"), "--png",
                        str(tmp_path / "png"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["comparison-distance.png",
                                                                   "comparison-rollout.png"]


def test_compare_with_cka_and_report_with_heads(pair_compare, tmp_path):
    data = vl.load_result(pair_compare.with_suffix(".json"))
    assert len(data.cka) == 1 and data.cka[0].matrix.shape == (6, 6) and data.cka[0].n_images == 8
    assert "Representation similarity: ref-vit vs ref-hybrid" in pair_compare.read_text()
    proc = run_cli_here("report", "--n-images", "6", "--heads", "--head-images", "6", "--out", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr
    assert "head importance: 48 heads x 6 images = 294 image forwards" in proc.stderr  # the cost, first
    report = vl.load_result(tmp_path / "r.json")
    assert report.heads[0].logit_drop.shape == (6, 8) and report.heads[0].base_accuracy is not None
    assert report.analyses[0].prefix.labels == ["class"]
    page = (tmp_path / "r.html").read_text()
    assert "Which heads matter" in page and "Attention on prefix tokens" in page


def test_reports_say_when_predictions_mean_nothing(tmp_path):
    proc = run_cli_here("report", "--model", "ref-vit", "--model", "vit_tiny_patch16_224", "--random-init",
                        "--samples", "--n-images", "1", "--out", str(tmp_path / "r.html"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "r.html").read_text()
    assert "know only six synthetic shapes" in page and "Random weights: the predictions mean nothing" in page
    shapes = run_cli_here("report", "--model", "ref-vit", "--n-images", "2", "--out", str(tmp_path / "s.html"),
                          "--quiet")
    assert shapes.returncode == 0 and "mean nothing" not in (tmp_path / "s.html").read_text()
    data = vl.load_result(tmp_path / "r.json")
    notes = data.notes
    assert notes["ref-vit"].startswith("The embedded models") and notes["vit_tiny_patch16_224"].startswith("Random")
    # each model's attention distance in one line, as the Compare view reads it, saying what is true of the model
    import html

    from vitlens.report.data import distance_reading

    assert data.weights == {"ref-vit": "embedded", "vit_tiny_patch16_224": "random init"}
    text = html.unescape(page)
    for a in data.analyses:
        reading = distance_reading(a.distance, a.spec.name, data.weights[a.spec.name])
        assert reading in text and reading.startswith(("Flat:", a.spec.name))
    assert "vit_tiny_patch16_224 is an embedded model" not in text


def test_help_describes_out_and_survey_takes_device_like_report_and_compare(tmp_path):
    """Issue 29 item 16: `report --help` showed `--out OUT` bare; `survey --device cuda` was unrecognised."""
    for command, default in (("report", "report.html"), ("compare", "compare.html"), ("survey-report", "survey.html")):
        proc = run_cli_here(command, "--help")
        assert "--out FILE" in proc.stdout and f"default {default}" in proc.stdout, proc.stdout
    import torch

    proc = run_cli_here("survey", "--models", "ref-vit", "--out", str(tmp_path / "s"), "--device", "cuda")
    if not torch.cuda.is_available():
        assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr and "unrecognized" not in proc.stderr
    proc = run_cli_here("survey", "--models", "ref-vit", "--out", str(tmp_path / "s"), "--device", "cpu",
                        "--num-gpus-per-worker", "1")
    assert proc.returncode == 2 and "contradict" in proc.stderr


def test_the_lazy_package_exports_what_it_imports_under_type_checking():
    """``vitlens`` imports its public names on first use (``vitlens._lazy``): each name of ``__all__`` is the object of
    the import written for it, and ``vl.survey`` stays the function after its subpackage is imported (the import
    system sets the package's attribute to the subpackage, which the eager import overwrote)."""
    import vitlens.survey.store  # noqa: F401
    from vitlens._lazy import exported
    from vitlens.loading import load_model
    from vitlens.survey.run import survey

    assert set(exported(vl.__file__)) == set(vl.__all__)
    assert vl.survey is survey and vl.load_model is load_model
    assert vl.figures.__name__ == "vitlens.figures"  # a module of the package, imported when asked for
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        vl.no_such_name  # noqa: B018


def test_a_fresh_process_reads_any_result_file_though_vitlens_imports_lazily(tmp_path):
    """``vl.load_result`` in a process that imported nothing else (the lazy ``vitlens`` registers no result kind at
    import) still reads every kind: a CKA inside a comparison failed with "Unknown result kind" before."""
    import numpy as np

    from vitlens.attribution.methods import AttributionResult

    path = AttributionResult(method="saliency", maps=np.zeros((1, 2, 2)), targets=np.zeros(1, dtype=int), grid=(2, 2),
                             image_size=(32, 32), seconds_per_image=0.0).save(tmp_path / "a.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys, vitlens as vl\nprint(type(vl.load_result(sys.argv[1])).__name__)"
    proc = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["AttributionResult"], proc.stderr
