"""Surveys on Ray: the merged numbers equal one process running the views, whatever the shards;
a driver killed with SIGKILL resumes to the same numbers; a worker process that dies mid-task is
retried; bad models and unreadable images are recorded while the rest finishes; an older folder
is extended, not corrupted; the table reads in pandas and duckdb; the report opens offline."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import vitlens as vl
from vitlens.reference.shapes import HELD_OUT_SEED, generate
from vitlens.survey import files_source, shapes_source
from vitlens.survey.sources import Shard
from vitlens.survey.stats import merge
from vitlens.survey.worker import run_shard

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium")
NO_BROWSER = CHROMIUM is None and not os.environ.get("CI")
N = 20


@pytest.fixture(scope="module")
def reference(shapes_survey):
    return shapes_survey  # conftest: ref-vit and an unknown model over N = 20 scenes, shards of 6


def test_merged_numbers_equal_one_process(reference):
    _out, result = reference
    images = list(generate(N, seed=HELD_OUT_SEED).images)
    m = vl.load_model("ref-vit", device="cpu")
    want = vl.attention_distance(m, images, batch_size=4)
    got = result.distance("ref-vit")
    assert got.n_images == N
    np.testing.assert_allclose(got.mean_px, want.mean_px, rtol=1e-6)
    np.testing.assert_allclose(got.std_px, want.std_px, rtol=1e-6, atol=1e-9)
    t = result.table
    acc = t[(t["model"] == "ref-vit") & (t["metric"] == "accuracy") & t["class"].isna()]["value"].item()
    data = generate(N, seed=HELD_OUT_SEED)
    assert acc == pytest.approx(float((m.logits(m.preprocess(list(data.images))).argmax(-1).numpy()
                                       == data.labels).mean()))
    rows = t[(t["model"] == "ref-vit") & (t["metric"] == "mean_distance_px") & t["class"].isna()]
    assert len(rows) == 6 * 8 and rows["value"].to_numpy() == pytest.approx(want.mean_px.ravel(), rel=1e-6)


def test_shard_size_and_merge_order_do_not_change_the_numbers():
    m = vl.load_model("ref-vit", device="cpu")
    source = shapes_source(N)
    views = ("distance", "rollout", "predictions")
    whole = run_shard(m, source, Shard(0, 0, N), views, batch_size=4)["states"]
    for size in (3, 7):
        parts = [run_shard(m, source, s, views, batch_size=4)["states"] for s in source.shards(size)]
        for order in (parts, parts[::-1]):
            merged = order[0]
            for p in order[1:]:
                merged = merge(merged, p)
            np.testing.assert_allclose(merged["distance"]["mean"], whole["distance"]["mean"], rtol=1e-6)
            np.testing.assert_allclose(merged["distance"]["class_mean"], whole["distance"]["class_mean"], rtol=1e-6)
            np.testing.assert_allclose(merged["rollout"]["sums"], whole["rollout"]["sums"], rtol=1e-6)
            np.testing.assert_array_equal(merged["predictions"]["correct"], whole["predictions"]["correct"])


def test_a_bad_model_is_recorded_while_the_others_finish(reference):
    out, result = reference
    assert result.models() == ["ref-vit"]
    assert "Unknown model 'no_such_model_x'" in result.failed["no_such_model_x"]
    manifest = vl.load_survey(out).manifest
    status = {m["name"]: m["status"] for m in manifest["models"].values()}
    assert status == {"ref-vit": "done", "no_such_model_x": "failed"}
    assert manifest["settings"]["shard_size"] == 6 and "ray" in manifest["versions"]
    assert len(manifest["models"][next(k for k, v in manifest["models"].items() if v["name"] == "ref-vit")]
               ["shards"]) == 4


def test_the_table_reads_in_pandas_and_duckdb(reference):
    import duckdb
    import pandas as pd

    out, _ = reference
    frame = pd.read_parquet(out / "table.parquet")
    assert list(frame.columns) == ["model", "weights", "layer", "head", "metric", "value", "n_images", "class",
                                   "stage"]
    assert frame["stage"].isna().all()  # a ViT's rows have no stage (a hierarchical model's name theirs)
    con = duckdb.connect()
    got = con.execute(f"select layer, median(value) from read_parquet('{out / 'table.parquet'}') "
                      "where metric = 'mean_distance_px' and class is null group by layer order by layer").fetchall()
    assert [r[0] for r in got] == list(range(1, 7))


@pytest.fixture(scope="module")
def extended(reference, tmp_path_factory):
    """The reference folder extended with a random-init vit_tiny (224 px beside ref-vit's 64 px):
    (folder, result, ref-vit's shard times before, after)."""
    out, _ = reference
    folder = tmp_path_factory.mktemp("extended") / "zoo"
    shutil.copytree(out, folder)
    vit_shards = sorted((folder / "shards").glob("ref-vit-*/*.npz"))
    stamps = [p.stat().st_mtime_ns for p in vit_shards]
    result = vl.survey(["ref-vit", "vit_tiny_patch16_224"], shapes_source(N), folder, shard_size=6, batch_size=4,
                       pretrained=False, progress=False, views=("distance", "rollout", "predictions", "weights"))
    return folder, result, stamps, [p.stat().st_mtime_ns for p in vit_shards]


def test_an_older_folder_is_extended_not_corrupted(reference, extended):
    out, _ = reference
    folder, result, stamps, after = extended
    assert after == stamps  # finished shards were not recomputed
    assert sorted(result.models()) == ["ref-vit", "vit_tiny_patch16_224"]
    assert "no_such_model_x" in result.failed  # the older run's record is kept
    np.testing.assert_allclose(result.distance("ref-vit").mean_px, vl.load_survey(out).distance("ref-vit").mean_px)
    with pytest.raises(vl.InvalidParameterError, match="other settings"):
        vl.survey(["ref-vit"], shapes_source(N), folder, shard_size=5, batch_size=4, progress=False)
    with pytest.raises(vl.InvalidParameterError, match="other images"):
        vl.survey(["ref-vit"], shapes_source(N + 1), folder, shard_size=6, batch_size=4, progress=False)


def test_random_init_says_and_records_that_the_embedded_model_keeps_its_weights(extended, capsys):
    """Issue 45 item 5: asked for random weights, ref-vit keeps its embedded trained ones; the run says so in one
    line, the manifest records it (weights "embedded", a weights_note) and survey --help says it."""
    folder, _, _, _ = extended
    vl.survey(["ref-vit", "vit_tiny_patch16_224"], shapes_source(N), folder, shard_size=6, batch_size=4,
              pretrained=False, progress=True, views=("distance", "rollout", "predictions", "weights"))
    said = [line for line in capsys.readouterr().err.splitlines() if "keeps its" in line]
    assert said == ["ref-vit: keeps its embedded trained weights: random init (--random-init, pretrained=False) "
                    "applies to hub models only"]
    entries = {e["name"]: e for e in vl.load_survey(folder).manifest["models"].values()}
    assert entries["ref-vit"]["weights"] == "embedded" and said[0].endswith(entries["ref-vit"]["weights_note"])
    assert entries["vit_tiny_patch16_224"]["weights"] == "random init"
    assert "weights_note" not in entries["vit_tiny_patch16_224"]
    from vitlens.cli import build_parser

    survey_help = next(a for a in build_parser()._subparsers._group_actions[0].choices["survey"]._actions
                       if "--random-init" in a.option_strings).help
    assert "embedded models and PATH@ARCH checkpoints keep their own weights" in survey_help


def test_a_random_init_model_is_found_by_the_name_given_and_its_weights_are_a_column(extended):
    folder, result, _, _ = extended
    tiny = result.distance("vit_tiny_patch16_224")  # the name the user gave, surveyed with --random-init
    assert tiny.n_images == N and tiny.model_name == "vit_tiny_patch16_224"
    t = vl.load_survey(folder).table
    assert dict(t.groupby("model")["weights"].unique().map(list)) == {
        "ref-vit": ["embedded"], "vit_tiny_patch16_224": ["random init"]}
    assert not t["model"].str.contains("random").any()
    with pytest.raises(vl.InvalidParameterError, match="no finished survey"):
        result.distance("vit_tiny_patch16_224", weights="pretrained")


def test_an_older_table_gets_its_weights_column(reference, tmp_path):
    """Folders written before the weights had a column (model "NAME (random init)") still load."""
    import json

    import pandas as pd

    out, _ = reference
    folder = tmp_path / "old"
    shutil.copytree(out, folder)
    table = pd.read_parquet(folder / "table.parquet").drop(columns="weights")
    table.to_parquet(folder / "table.parquet", index=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["models"].values():
        entry.pop("weights", None)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    result = vl.load_survey(folder)
    assert list(result.table.columns[:2]) == ["model", "weights"]
    assert set(result.table["weights"]) == {"embedded"} and result.models() == ["ref-vit"]


def test_the_survey_page_speaks_in_image_widths_and_words(extended):
    from vitlens.report.survey import summary_rows, survey_figures, survey_html

    _, result, _, _ = extended
    figs = survey_figures(result)
    legend = [tr.name for tr in figs["depth"].data]
    assert legend == ["ref-vit (ViT, embedded)", "vit_tiny_patch16_224 (ViT, random init)"]
    per_class = figs["per-class"]  # a 64-px and a 224-px model: pixels would show the input size only
    assert per_class.data[0].colorbar.title.text == "widths" and "pixels" not in per_class.layout.title.text
    assert 0 < np.nanmax(per_class.data[0].z) < 1
    rows = {r["model"]: r for r in summary_rows(result)}
    assert rows["vit_tiny_patch16_224"]["accuracy note"] == "random weights: the accuracy means nothing"
    assert rows["ref-vit"]["accuracy note"] == ""  # the embedded models on their own shape scenes
    # issue 29 item 12: the rollout entropy names its unit; an 8x8 grid holds at most ln 64 nats
    assert 0 < rows["ref-vit"]["rollout entropy (nats)"] <= np.log(64) + 1e-9
    page = survey_html(result)
    assert "<div class='table-wrap'><table class='sortable'>" in page  # issue 29 item 13: scrolls, never spills
    assert "shards of 6 images · batches of 4 · views: distance, rollout, predictions, weights" in page
    assert "{&#x27;shard_size&#x27;" not in page and "{'shard_size'" not in page
    assert "(random init) (vit)" not in page and "random weights: the accuracy means nothing" in page


def test_unreadable_images_are_skipped_and_counted(local_ray, tmp_path):
    folder = tmp_path / "photos"
    for cls in ("cat", "dog"):
        (folder / cls).mkdir(parents=True)
    for i, img in enumerate(vl.sample_images()):
        img.resize((64, 64)).save(folder / ("cat" if i % 2 else "dog") / f"{i}.png")
    (folder / "cat" / "broken.jpg").write_bytes(b"not a jpeg")
    source = files_source(str(folder), per_class=True)
    assert source.classes == ("cat", "dog") and len(source) == 5
    result = vl.survey(["ref-vit"], source, tmp_path / "out", shard_size=3, batch_size=4, progress=False)
    entry = next(iter(result.manifest["models"].values()))
    assert entry["skipped"] == ["broken.jpg"] and entry["n_images"] == 4
    t = result.table
    per_class = t[(t["metric"] == "accuracy") & t["class"].notna()]
    assert sorted(per_class["class"]) == ["cat", "dog"] and per_class["n_images"].sum() == 4


def test_a_worker_process_killed_mid_task_is_retried_with_identical_numbers(reference, tmp_path, monkeypatch):
    out, _ = reference
    marker = tmp_path / "crashed"
    mark = str(marker)
    from vitlens.survey import run as survey_run
    from vitlens.survey.worker import SurveyWorker

    class CrashingOnce(SurveyWorker):
        """The fault, injected by this test alone: the first shard's process dies in the middle of it (the
        class is defined here, so Ray ships it to the workers by value; the marker makes it once)."""

        def run(self, *args, **kwargs):
            if not os.path.exists(mark):
                with open(mark, "w") as f:
                    f.write(str(os.getpid()))
                os._exit(1)  # a real process death in the middle of a shard
            return super().run(*args, **kwargs)

    monkeypatch.setattr(survey_run, "SurveyWorker", CrashingOnce)
    result = vl.survey(["ref-vit"], shapes_source(N), tmp_path / "zoo", shard_size=6, batch_size=4, progress=False)
    assert marker.is_file()  # a worker really died in the middle of a shard
    assert result.models() == ["ref-vit"] and not result.failed
    np.testing.assert_array_equal(result.distance("ref-vit").mean_px, vl.load_survey(out).distance("ref-vit").mean_px)


def test_a_rerun_says_what_it_computed_and_what_it_reused_and_a_failure_once(reference, tmp_path, capsys):
    out, _ = reference
    folder = tmp_path / "zoo"
    shutil.copytree(out, folder)
    next((folder / "shards").glob("ref-vit-*/shard-00000.npz")).unlink()  # as if interrupted before it finished
    vl.survey(["ref-vit", "no_such_model_x"], shapes_source(N), folder, shard_size=6, batch_size=4)
    captured = capsys.readouterr()
    assert "no_such_model_x" not in captured.out and "done" not in captured.out  # stderr, once each
    lines = captured.err.replace("\r", "\n").splitlines()
    assert "ref-vit: done: 1 shard computed this run (6 images), 3 reused" in lines
    assert len([line for line in lines if "no_such_model_x" in line]) == 1
    vl.survey(["ref-vit"], shapes_source(N), folder, shard_size=6, batch_size=4)
    assert "ref-vit: already done (4 shards reused)" in capsys.readouterr().err


def test_rays_messages_go_to_the_survey_folder_not_the_terminal(tmp_path, capsys):
    import logging

    import ray._private.worker as ray_worker

    from vitlens.survey.run import ray_messages_to

    log = tmp_path / "logs" / "ray-driver.log"
    with ray_messages_to(log):
        logging.getLogger("ray._private.authentication.authentication_token_setup").warning(
            "Token authentication is enabled for this Ray cluster.")
        # what Ray's error listener thread does with "(raylet) Task ... failed ... retries" (it ignores log_to_driver)
        ray_worker.print_to_stdstream({"lines": ["Task SurveyWorker.run failed. There are 3 retries remaining"],
                                       "pid": "raylet", "is_err": False}, ignore_prefix=False)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    text = log.read_text()
    assert "Token authentication is enabled" in text and "(raylet) Task SurveyWorker.run failed" in text
    assert ray_worker.print_to_stdstream.__module__ == "ray._private.worker"  # put back


def test_ctrl_c_says_which_shards_were_kept(reference, tmp_path, monkeypatch, capsys):
    from vitlens.cli import main

    out, _ = reference
    folder = tmp_path / "zoo"

    def interrupted(names, source, where, **kwargs):
        shutil.copytree(out, where)  # 4 shards of ref-vit finished, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(vl, "survey", interrupted)
    assert main(["survey", "--models", "ref-vit", "--out", str(folder), "--quiet"]) == 130
    assert capsys.readouterr().err.strip() == (f"vitlens: interrupted; 4 finished shards kept in {folder}; a rerun "
                                               "with the same command resumes from them.")

    def before_any_shard(names, source, where, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(vl, "survey", before_any_shard)
    assert main(["survey", "--models", "ref-vit", "--out", str(tmp_path / "new"), "--quiet"]) == 130
    assert capsys.readouterr().err.strip() == "vitlens: interrupted; nothing was written."


def survey_args(out: Path, address: str, *extra: str) -> list[str]:
    """The arguments of ``vitlens survey`` over 24 scenes in shards of 4, as a driver of the suite's Ray."""
    return ["survey", "--models", "ref-vit", "--n-images", "24", "--shard-size", "4", "--batch-size", "4",
            "--out", str(out), "--quiet", "--address", address, *extra]


def survey_cli(out: Path, address: str, *extra: str) -> subprocess.Popen:
    """``vitlens survey`` in its own process, as a driver of the module's Ray cluster (``--address``)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "vitlens", *survey_args(out, address, *extra)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture(scope="module")
def address(local_ray) -> str:
    return local_ray.get_runtime_context().gcs_address


def test_a_driver_killed_with_sigkill_resumes_to_the_same_numbers(tmp_path, address, ref_vit):
    """A ``vitlens survey`` process killed with SIGKILL; the same command, rerun (here through ``main`` in this
    process, a driver of the same Ray), finishes from the shards it left and gives the one-process numbers."""
    from vitlens.cli import main

    out = tmp_path / "zoo"
    # 12 shards, which one worker computes in turn: still running when the kill comes, 0.05 s after the second
    args = ("--n-images", "48")
    proc = survey_cli(out, address, *args)
    deadline = time.time() + 240
    while time.time() < deadline and len(list(out.glob("shards/*/*.npz"))) < 2:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver dies; Ray ends the actors it owned
    proc.wait()
    finished = len(list(out.glob("shards/*/*.npz")))
    assert 2 <= finished < 12, finished
    assert main(survey_args(out, address, *args)) == 0
    result = vl.load_survey(out)
    assert len(list(out.glob("shards/*/*.npz"))) == 12
    images = list(generate(48, seed=HELD_OUT_SEED).images)
    want = vl.attention_distance(ref_vit, images, batch_size=4)
    np.testing.assert_allclose(result.distance("ref-vit").mean_px, want.mean_px, rtol=1e-6)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_on_the_command_line_says_what_was_kept(tmp_path, address, sig):
    """Ctrl-C, and SIGTERM as Ctrl-C (it printed Ray's C++ stack dump and exited -6)."""
    out = tmp_path / "zoo"
    proc = survey_cli(out, address, "--n-images", "200")  # 50 shards: still running when Ctrl-C comes
    deadline = time.time() + 240
    while time.time() < deadline and len(list(out.glob("shards/*/*.npz"))) < 2:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    kept = len(list(out.glob("shards/*/*.npz")))
    assert proc.returncode == 130 and 2 <= kept < 50, err
    assert err.strip().splitlines()[-1] == (f"vitlens: interrupted; {kept} finished shards kept in {out}; a rerun "
                                            "with the same command resumes from them.")


def test_cli_reports_failed_models_in_one_line_each_and_strict_stops(tmp_path, address):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "vitlens", "survey", "--models", "ref-vit", "resnet50", "--random-init",
           "--max-images", "4", "--out", str(tmp_path / "a"), "--quiet", "--address", address]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("vitlens: failed:")]
    assert len(lines) == 1 and "resnet50" in lines[0] and "not a Vision Transformer" in lines[0]
    # said once (not again on stdout), and none of Ray's own lines
    assert proc.stdout == "" and len([line for line in proc.stderr.splitlines() if "resnet50" in line]) == 1
    assert "(raylet)" not in proc.stderr and (tmp_path / "a" / "logs" / "ray-driver.log").is_file()
    assert vl.load_survey(tmp_path / "a").models() == ["ref-vit"]
    with pytest.raises(vl.VitlensError, match="--strict"):
        vl.survey(["resnet50", "ref-vit"], shapes_source(4), tmp_path / "b", pretrained=False, strict=True,
                  progress=False)


@pytest.mark.skipif(NO_BROWSER, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_survey_report_opens_offline_in_chromium(reference, tmp_path):
    from playwright.sync_api import sync_playwright

    out, _ = reference
    from vitlens.cli import main

    page_path = tmp_path / "zoo.html"
    assert main(["survey-report", str(out), "--out", str(page_path)]) == 0  # the command, in this process
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(page_path.as_uri())
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 3", timeout=30000)
        page.locator("table.sortable th", has_text="layer-1 median").click()  # sorts without errors
        text = page.inner_text("body")
        browser.close()
    assert "no_such_model_x" in text and "ref-vit" in text
    assert [u for u in requests if not u.startswith(("file:", "data:", "blob:"))] == []


def _damage(folder: Path) -> dict[str, bytes]:
    """Truncate ref-vit's shard 1 to half and zero its shard 2, as a bad disk or copy would: their bytes before."""
    one, two = (next((folder / "shards").glob(f"ref-vit-*/shard-0000{i}.npz")) for i in (1, 2))
    before = {"shard-00001": one.read_bytes(), "shard-00002": two.read_bytes()}
    one.write_bytes(before["shard-00001"][: len(before["shard-00001"]) // 2])
    two.write_bytes(bytes(len(before["shard-00002"])))
    return before


def test_a_damaged_folder_loads_and_names_its_damaged_shards(reference, tmp_path, capsys):
    from vitlens.cli import main
    from vitlens.survey.store import DamagedShardError, DamagedSurveyWarning

    out, _ = reference
    folder = tmp_path / "zoo"
    shutil.copytree(out, folder)
    _damage(folder)
    with pytest.warns(DamagedSurveyWarning, match=r"shard-00001 \(truncated .*shard-00002 \(zeroed"):
        result = vl.load_survey(folder)
    assert set(result.damaged["ref-vit"]) == {"shard-00001", "shard-00002"}
    assert result.damaged["ref-vit"]["shard-00001"].startswith("truncated (")
    assert "2 damaged shards" in repr(result)
    with pytest.raises(DamagedShardError, match=r"shard-00001.npz is damaged: truncated .* Rerun"):
        result.distance("ref-vit")
    assert main(["survey-report", str(folder), "--out", str(tmp_path / "zoo.html"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "BadZipFile" not in err and "shard-00001 (truncated" in err and "shard-00002 (zeroed" in err


def test_a_shard_is_trusted_by_its_checksum_or_for_older_folders_by_reading_back(reference, tmp_path):
    from vitlens.survey.store import SurveyStore

    out, _ = reference
    folder = tmp_path / "zoo"
    shutil.copytree(out, folder)
    store, shards = SurveyStore(folder), shapes_source(N).shards(6)
    key = next(k for k, v in store.manifest()["models"].items() if v["name"] == "ref-vit")
    assert store.damaged(key, shards) == {} and store.checksum_path(key, shards[0]).is_file()
    path = store.shard_path(key, shards[3])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    path.write_bytes(bytes(data))
    assert "fails its checksum" in store.problem(key, shards[3])
    store.checksum_path(key, shards[0]).unlink()  # a folder from before the records: read back instead
    assert store.problem(key, shards[0]) == ""
    store.checksum_path(key, shards[3]).unlink()
    assert store.problem(key, shards[3]).startswith("cannot be read (")


def test_a_rerun_sets_damaged_shards_aside_and_recomputes_exactly_those(reference, tmp_path, capsys):
    import pandas as pd

    out, _ = reference
    folder = tmp_path / "zoo"
    shutil.copytree(out, folder)
    before = _damage(folder)
    kept = {p.name: p.stat().st_mtime_ns for p in (folder / "shards").glob("ref-vit-*/shard-0000[03].npz")}
    result = vl.survey(["ref-vit"], shapes_source(N), folder, shard_size=6, batch_size=4)
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    damaged_lines = [line for line in lines if "is damaged" in line]
    assert len(damaged_lines) == 2, lines
    assert "ref-vit: shard-00001 is damaged (truncated" in damaged_lines[0] and "set aside as shards/" in damaged_lines[0]
    assert "ref-vit: shard-00002 is damaged (zeroed" in damaged_lines[1]
    assert "ref-vit: done: 2 shards computed this run (12 images), 2 reused" in lines
    assert {p.name: p.stat().st_mtime_ns for p in (folder / "shards").glob("ref-vit-*/shard-0000[03].npz")} == kept
    for name, data in before.items():  # set aside with the damaged bytes, not deleted
        moved = list((folder / "shards").glob(f"ref-vit-*/{name}.npz.damaged-*"))
        assert len(moved) == 1 and moved[0].read_bytes() != data
    entry = next(v for v in result.manifest["models"].values() if v["name"] == "ref-vit")
    assert [s["shard"] for s in entry["set_aside"]] == ["shard-00001", "shard-00002"]
    assert not result.damaged
    pd.testing.assert_frame_equal(result.table, vl.load_survey(out).table, check_exact=False, rtol=1e-6)
    np.testing.assert_allclose(result.distance("ref-vit").mean_px, vl.load_survey(out).distance("ref-vit").mean_px,
                               rtol=1e-6)


def _ref_vit_checkpoint(path: Path, seed: int) -> None:
    """ref-vit's weights, nudged by a seeded amount: a fine-tuned checkpoint of the same architecture."""
    import torch
    from safetensors.torch import save_file

    state = vl.load_model("ref-vit", device="cpu").model.state_dict()
    g = torch.Generator().manual_seed(seed)
    save_file({k: (v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v).contiguous()
               for k, v in state.items()}, str(path))


def test_two_checkpoints_side_by_side_and_one_whose_weights_changed_is_recomputed(local_ray, tmp_path, capsys):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _ref_vit_checkpoint(a, 1)
    _ref_vit_checkpoint(b, 2)
    names = [f"{a}@ref-vit", f"{b}@ref-vit"]
    folder, n = tmp_path / "zoo", 8
    first = vl.survey(names, shapes_source(n), folder, shard_size=4, batch_size=4, progress=False,
                      views=("distance",))
    assert sorted(first.models()) == sorted(names) and not first.failed
    assert set(first.table["weights"]) == {"checkpoint"}
    entries = {e["name"]: e for e in first.manifest["models"].values()}
    assert entries[names[0]]["checkpoint"]["sha256"] == file_sha(a) and entries[names[0]]["checkpoint"]["arch"] == "ref-vit"
    a_shards = sorted((folder / "shards" / entries[names[0]]["key"]).glob("*.npz"))
    a_stamps = [p.stat().st_mtime_ns for p in a_shards]
    images = list(generate(n, seed=HELD_OUT_SEED).images)
    want = vl.attention_distance(vl.load_model(str(a), arch="ref-vit", device="cpu"), images, batch_size=4)
    np.testing.assert_allclose(first.distance(names[0]).mean_px, want.mean_px, rtol=1e-6)  # a's own numbers
    old_b = first.distance(names[1]).mean_px
    assert not np.allclose(old_b, want.mean_px)  # b's are its own

    _ref_vit_checkpoint(b, 3)  # b's file now holds other weights
    second = vl.survey(names, shapes_source(n), folder, shard_size=4, batch_size=4, views=("distance",))
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    changed = [line for line in lines if "weights changed" in line]
    assert len(changed) == 1 and changed[0].startswith(f"{names[1]}: its weights changed since its shards were "
                                                       "written") and "2 old shards set aside" in changed[0]
    assert f"{names[0]}: already done (2 shards reused)" in lines
    assert f"{names[1]}: done: 2 shards computed this run ({n} images)" in lines  # none of the old ones reused
    assert [p.stat().st_mtime_ns for p in a_shards] == a_stamps
    want = vl.attention_distance(vl.load_model(str(b), arch="ref-vit", device="cpu"), images, batch_size=4)
    np.testing.assert_allclose(second.distance(names[1]).mean_px, want.mean_px, rtol=1e-6)
    assert not np.allclose(second.distance(names[1]).mean_px, old_b)
    entry = next(e for e in second.manifest["models"].values() if e["name"] == names[1])
    assert entry["checkpoint"]["sha256"] == file_sha(b) and len(entry["set_aside"]) == 2
    assert len(list((folder / "shards" / entry["key"]).glob("*.npz.weights-changed-*"))) == 2


def file_sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_command_line_takes_checkpoints_as_path_at_arch(tmp_path, monkeypatch):
    from vitlens.cli import main
    from vitlens.survey.store import checkpoint_of

    seen = {}
    monkeypatch.setattr(vl, "survey", lambda names, *a, **k: seen.setdefault("names", names) and 1 / 0)
    (tmp_path / "zoo.txt").write_text("ref-vit\nruns/epoch3.safetensors@vit_tiny_patch16_224  # mine\n")
    main(["survey", "--models", "ft.pth@ref-vit", "--models-file", str(tmp_path / "zoo.txt"),
          "--out", str(tmp_path / "out"), "--quiet"])
    assert seen["names"] == ["ft.pth@ref-vit", "ref-vit", "runs/epoch3.safetensors@vit_tiny_patch16_224"]
    assert checkpoint_of("runs/epoch3.safetensors@vit_tiny_patch16_224") == ("runs/epoch3.safetensors",
                                                                             "vit_tiny_patch16_224")
    assert checkpoint_of("vit_tiny_patch16_224") is None and checkpoint_of("hf:org/vit@main") is None


# a local survey (no --address) that stops once its model's worker is up, says the GCS address and
# waits for a line on stdin before it finishes
LOCAL_SURVEY = r"""
import importlib, os, sys
import vitlens as vl
from vitlens.survey import shapes_source

run = importlib.import_module("vitlens.survey.run")  # vl.survey is the function

real = run._collect

def collect(ray, work, *args, **kwargs):
    ray.get([w.load for w in work.values()])
    print("READY", ray.get_runtime_context().gcs_address, os.environ.get("RAY_AUTH_MODE"), flush=True)
    sys.stdin.readline()
    return real(ray, work, *args, **kwargs)

run._collect = collect
result = vl.survey(["ref-vit"], shapes_source(4), sys.argv[1], shard_size=2, batch_size=2, progress=False,
                   num_cpus=1, views=("distance",))
print("DONE", result.models(), flush=True)
"""

# a driver joining the cluster at argv[1]: with the token when RAY_AUTH_TOKEN is in its environment
RAY_CLIENT = r"""
import sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
    print("CONNECTED", ray.cluster_resources().get("CPU"))
except Exception as e:
    print("REFUSED", type(e).__name__, " ".join(str(e).split())[:300])
"""


def first_line_with(text: str, cmd: list[str], env: dict[str, str], timeout: float = 90) -> str:
    """The first line of ``cmd``'s stderr that holds ``text`` ("" if none came before it ended or
    the timeout); the process is then killed."""
    client = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    timer = threading.Timer(timeout, lambda: os.killpg(client.pid, signal.SIGKILL))
    timer.start()
    try:
        return next((line for line in client.stderr if text in line), "")
    finally:
        timer.cancel()
        if client.poll() is None:
            os.killpg(client.pid, signal.SIGKILL)
        client.wait()
        client.stderr.close()


def listening_sockets(root: int) -> list[tuple[str, str, int]]:
    """(process name, local address, port) of every listening TCP socket held by ``root`` or its descendants."""
    import socket

    inodes = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in (Path("/proc/net") / table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].split(":")
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                inodes[fields[9]] = (socket.inet_ntop(family, raw), int(port, 16))
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                found.add((name, *inodes[link[8:-1]]))
    return sorted(found)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc")
@pytest.mark.heavy  # conftest.HEAVY: handed out before the short tests
def test_a_local_survey_listens_on_loopback_only_and_refuses_clients_without_the_token(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", LOCAL_SURVEY, str(tmp_path / "zoo")], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), (line, proc.stderr.read() if proc.poll() is not None else "")
        _, gcs, mode = line.split()
        sockets = listening_sockets(proc.pid)
        token = home / ".ray" / "auth_token"
        # keep 127.0.0.1 in the clients (Ray resolves a loopback address to the routable one)
        client_env = {**env, "HOME": str(tmp_path), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        refused = first_line_with("InvalidAuthToken", [sys.executable, "-c", RAY_CLIENT, gcs], client_env)
        admitted = subprocess.run([sys.executable, "-c", RAY_CLIENT, gcs], capture_output=True, text=True,
                                  timeout=120, env={**client_env, "RAY_AUTH_MODE": "token",
                                                    "RAY_AUTH_TOKEN": token.read_text().strip()})
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    names = {name for name, _, _ in sockets}
    # the GCS, the raylet (node manager and object manager), the driver's and the worker's core-worker servers
    assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), sockets
    assert all(address in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for _, address, _ in sockets), sockets
    assert gcs.startswith("127.0.0.1:") and mode == "token"
    # no token: the GCS itself says no (the client retries for ~20 s before it gives up; its first refusal is enough)
    assert "Unauthenticated" in refused and "InvalidAuthToken: Authentication token is missing" in refused, refused
    assert admitted.stdout.strip() == "CONNECTED 1.0", admitted  # the same client with the token gets in
    assert token.stat().st_mode & 0o777 == 0o600
    assert proc.returncode == 0 and "DONE ['ref-vit']" in out, err
    manifest = vl.load_survey(tmp_path / "zoo").manifest
    assert manifest["ray"]["listen"] == "127.0.0.1" and manifest["ray"]["auth"] == "token"


def test_ctrl_c_while_a_shard_is_written_waits_for_the_whole_shard(tiny, tmp_path, monkeypatch):
    """CI once saw Ctrl-C land inside np.savez: the zip's clean-up raised a ValueError in place of the
    KeyboardInterrupt. The interrupt now waits for the shard, which is then whole and trusted."""
    from vitlens.survey import shard_store as store_module
    from vitlens.survey.store import SurveyStore

    source = shapes_source(4)
    shard = source.shards(4)[0]
    result = run_shard(tiny, source, shard, ("distance",), batch_size=4)
    real = store_module.np.savez_compressed

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives mid-write
        return real(*args, **kwargs)

    monkeypatch.setattr(store_module.np, "savez_compressed", interrupted)
    store = SurveyStore(tmp_path / "zoo")
    with pytest.raises(KeyboardInterrupt):
        store.write_shard("m", shard, result)
    assert store.problem("m", shard) == ""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler given back
