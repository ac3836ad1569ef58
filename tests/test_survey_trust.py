"""Survey folders under hostile or clumsy use (issue 33, items 2-5): two runs in one folder, shards copied in or
over each other, images replaced under their names, --out inside the images, symlink loops in a glob."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import vitlens as vl
from vitlens.survey import files_source, shapes_source
from vitlens.survey.sources import Shard
from vitlens.errors import InvalidParameterError
from vitlens.survey.store import DamagedSurveyWarning, SurveyBusyError, SurveyStore

ray = pytest.importorskip("ray")
N, SHARD = 8, 4


@pytest.fixture(scope="module")
def pair(local_ray, tmp_path_factory):
    """ref-vit and ref-hybrid over 8 scenes, two shards each: the folder, and each model's mean distance."""
    out = tmp_path_factory.mktemp("trust") / "zoo"
    result = vl.survey(["ref-vit", "ref-hybrid"], shapes_source(N), out, shard_size=SHARD, batch_size=4,
                       views=("distance",), progress=False)
    return out, {m: result.distance(m).mean_px for m in ("ref-vit", "ref-hybrid")}


def _shard_dir(folder: Path, model: str) -> Path:
    return next(p for p in (folder / "shards").iterdir() if p.name.startswith(model + "-"))


def test_a_second_survey_in_a_busy_folder_is_refused_and_both_are_kept_after(local_ray, tmp_path):
    out = tmp_path / "zoo"
    errors: list[BaseException] = []

    def first() -> None:
        try:
            vl.survey(["ref-vit"], shapes_source(N), out, shard_size=SHARD, batch_size=4, views=("distance",),
                      progress=False)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    deadline = time.time() + 60
    while not ((out / ".lock").is_file() and (out / ".lock").read_text()) and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(SurveyBusyError, match="being written by another vitlens survey .pid"):
        vl.survey(["ref-hybrid"], shapes_source(N), out, shard_size=SHARD, batch_size=4, views=("distance",),
                  progress=False)
    t.join(120)
    assert not errors
    result = vl.survey(["ref-hybrid"], shapes_source(N), out, shard_size=SHARD, batch_size=4, views=("distance",),
                       progress=False)
    assert sorted(result.models()) == ["ref-hybrid", "ref-vit"]
    assert set(result.table["model"]) == {"ref-hybrid", "ref-vit"}


def test_a_survey_in_its_first_moments_is_busy_not_a_foreign_folder(tmp_path):
    """A second survey that arrives while the first holds the lock and is writing its manifest (a temporary file
    beside the .lock, no manifest.json yet) is told the folder is busy, not that it is no survey's folder."""
    out = tmp_path / "zoo"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from vitlens.survey.store import SurveyStore\n"
        f"with SurveyStore({str(out)!r}).lock():\n"
        f"    Path({str(out)!r}, '.manifest.json.x1y2.tmp').write_text('{{')\n"
        "    print('held', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SurveyBusyError, match=f"being written by another vitlens survey .pid {holder.pid}"):
            vl.survey(["ref-vit"], shapes_source(N), out, shard_size=SHARD, progress=False)
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_run_does_not_leave_the_folder_locked(tmp_path):
    out = tmp_path / "zoo"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from vitlens.survey.store import SurveyStore\n"
        f"with SurveyStore({str(out)!r}).lock():\n    print('held', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SurveyBusyError, match=f"pid {holder.pid}"):
            with SurveyStore(out).lock():
                pass
    finally:
        holder.kill()
        holder.wait()
    with SurveyStore(out).lock():  # SIGKILL dropped it
        pass


def test_the_manifest_is_merged_never_overwriting_another_runs_models(pair, tmp_path):
    out, _ = pair
    folder = tmp_path / "zoo"
    shutil.copytree(out, folder)
    store = SurveyStore(folder)
    mine = store.manifest()
    vit = next(k for k, e in mine["models"].items() if e["name"] == "ref-vit")
    del mine["models"][vit]  # a run that never knew ref-vit writes its manifest
    store.write_manifest(mine)
    assert any(e["name"] == "ref-vit" for e in store.manifest()["models"].values())


@pytest.mark.parametrize("how", ["other model", "other index"])
def test_a_copied_shard_is_set_aside_and_recomputed(pair, tmp_path, capsys, how):
    out, means = pair
    folder = tmp_path / "zoo"
    shutil.copytree(out, folder)
    vit = _shard_dir(folder, "ref-vit")
    source = _shard_dir(folder, "ref-hybrid") / "shard-00001.npz" if how == "other model" else vit / "shard-00000.npz"
    for suffix in ("", ".sha256"):  # the shard with its own checksum record
        shutil.copyfile(f"{source}{suffix}", vit / f"shard-00001.npz{suffix}")
    with pytest.warns(DamagedSurveyWarning, match="belongs elsewhere"):
        assert "ref-vit" in vl.load_survey(folder).damaged
    result = vl.survey(["ref-vit"], shapes_source(N), folder, shard_size=SHARD, batch_size=4, views=("distance",))
    err = capsys.readouterr().err
    assert "ref-vit: shard-00001 belongs elsewhere: its record says" in err, err
    assert list(vit.glob("shard-00001.npz.mismatch-*"))
    np.testing.assert_array_equal(result.distance("ref-vit").mean_px, means["ref-vit"])
    np.testing.assert_array_equal(result.distance("ref-hybrid").mean_px, means["ref-hybrid"])


def _photos(folder: Path, n: int = 4) -> None:
    folder.mkdir(parents=True)
    for i, img in enumerate(vl.sample_images()[:n]):
        img.resize((64, 64)).save(folder / f"{i}.png")


def test_an_image_replaced_under_its_name_recomputes_its_shard_and_says_which(local_ray, ref_vit, tmp_path, capsys):
    photos = tmp_path / "photos"
    _photos(photos)
    out = tmp_path / "zoo"
    kw = dict(shard_size=2, batch_size=2, views=("distance",))
    vl.survey(["ref-vit"], str(photos), out, **kw)
    capsys.readouterr()
    kept = (_shard_dir(out, "ref-vit") / "shard-00000.npz").read_bytes()
    vl.sample_images()[3].resize((64, 64)).rotate(90).save(photos / "2.png")  # shard-00001 holds 2.png and 3.png
    stat = (photos / "2.png").stat()
    os.utime(photos / "2.png", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    result = vl.survey(["ref-vit"], str(photos), out, **kw)
    err = capsys.readouterr().err
    assert "ref-vit: shard-00001 was computed from images that changed since (2.png)" in err, err
    assert "1 shard computed this run (2 images), 1 reused" in err
    assert (_shard_dir(out, "ref-vit") / "shard-00000.npz").read_bytes() == kept
    # the numbers of the new images, read as the survey reads them, in this process (a fresh survey gives the same:
    # tests/test_survey.py::test_merged_numbers_equal_one_process)
    source = files_source(str(photos))
    images = source.read(Shard(0, 0, len(source)))[0]
    fresh = vl.attention_distance(ref_vit, images, batch_size=2)
    np.testing.assert_allclose(result.distance("ref-vit").mean_px, fresh.mean_px, rtol=1e-6)


def test_same_size_and_time_is_caught_with_hash_images(tmp_path):
    photos = tmp_path / "photos"
    _photos(photos, 2)
    a = files_source(str(photos), hash_images=True)
    data = bytearray((photos / "1.png").read_bytes())
    st = (photos / "1.png").stat()
    data[-20] ^= 0xFF  # one byte flipped, same size, same mtime put back
    (photos / "1.png").write_bytes(bytes(data))
    os.utime(photos / "1.png", ns=(st.st_atime_ns, st.st_mtime_ns))
    b = files_source(str(photos), hash_images=True)
    assert a.stats[0] == b.stats[0] and a.stats[1][:2] == b.stats[1][:2] and a.stats[1][2] != b.stats[1][2]
    assert a.range_digest(1, 2) != b.range_digest(1, 2) and a.range_digest(0, 1) == b.range_digest(0, 1)


def test_out_inside_the_images_is_refused_before_anything_is_written(tmp_path):
    photos = tmp_path / "photos"
    _photos(photos, 2)
    with pytest.raises(InvalidParameterError, match="inside the image folder"):
        vl.survey(["ref-vit"], str(photos), photos / "zoo", progress=False)
    assert not (photos / "zoo").exists()


def test_a_local_rays_logs_are_copied_as_regular_files_only_and_kept_private(tmp_path):
    """Another user's planted links in a Ray session's logs (a link to a private file of the victim's, a link to
    /dev/zero, a FIFO, a linked folder) are never followed nor opened: only the regular files are copied, as files
    and folders only the user can read."""
    from vitlens.survey.run import copy_regular_files

    logs, secret_dir = tmp_path / "session" / "logs", tmp_path / "victim"
    (logs / "old").mkdir(parents=True)
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "secret.txt").write_text("the victim's secret")
    (logs / "raylet.out").write_text("raylet started")
    (logs / "old" / "gcs_server.err").write_text("gcs")
    (logs / "leak.log").symlink_to(secret_dir / "secret.txt")
    (logs / "zero.log").symlink_to("/dev/zero")
    (logs / "linked").symlink_to(secret_dir, target_is_directory=True)
    os.mkfifo(logs / "pipe.log")
    out = tmp_path / "out" / "logs" / "ray-session"
    assert copy_regular_files(logs, out) == 2
    copied = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert copied == ["old", "old/gcs_server.err", "raylet.out"]
    assert (out / "raylet.out").read_text() == "raylet started"
    assert all(p.stat().st_mode & 0o777 == (0o700 if p.is_dir() else 0o600) for p in [out, *out.rglob("*")])


def test_a_local_rays_temporary_folder_is_private_and_removed_after(monkeypatch):
    """The folder a local Ray's session goes to: inside a private folder of the user's (mode 0700), a short path
    (Ray's socket paths), removed by ``restore_local_env``; none where RAY_TMPDIR says where Ray's files go."""
    from vitlens.survey import ray_setup

    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    # this test's own records: the suite's session Ray (conftest.local_ray) keeps its folder and environment
    monkeypatch.setattr(ray_setup, "_PRIVATE_TEMP", [])
    monkeypatch.setattr(ray_setup, "_ENV_BEFORE", {})
    temp = ray_setup.private_ray_temp()
    st = temp.parent.stat()
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700 and len(str(temp)) < 60
    assert temp.parent.name.startswith("vitlens-ray-") and not str(temp).startswith("/tmp/ray/")
    ray_setup.restore_local_env()
    assert not temp.parent.exists()
    monkeypatch.setenv("RAY_TMPDIR", "/somewhere/of/the/users")
    assert ray_setup.private_ray_temp() is None


def test_a_long_tmpdir_leaves_room_for_rays_socket_paths(monkeypatch, tmp_path):
    """Issue 62, item 12: with a TMPDIR of 33 characters every local survey exited 1 ("AF_UNIX path length cannot
    exceed 107 bytes"): the private folder went under any TMPDIR of up to 40 characters, while Ray adds about 66
    below it. Now it goes under TMPDIR only when Ray's longest socket path fits, else under /tmp (the local Ray's
    real socket paths are measured against ``RAY_SOCKET_TAIL`` in the next test; a whole survey under such a TMPDIR
    in ``test_a_local_survey_runs_its_ray_in_a_private_folder_and_removes_it``)."""
    import tempfile

    from vitlens.survey import ray_setup

    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    # this test's own records: the suite's session Ray (conftest.local_ray) keeps its folder and environment
    monkeypatch.setattr(ray_setup, "_PRIVATE_TEMP", [])
    monkeypatch.setattr(ray_setup, "_ENV_BEFORE", {})
    for length in (4, 20, 33, 60):
        base = Path("/tmp") if length == 4 else Path(tempfile.mkdtemp(dir="/tmp", prefix="x" * (length - 13)))
        assert len(str(base)) == length  # /tmp/, the prefix, mkdtemp's 8 characters
        monkeypatch.setattr(tempfile, "tempdir", str(base))
        temp = ray_setup.private_ray_temp()
        assert len(str(temp)) + ray_setup.RAY_SOCKET_TAIL <= ray_setup.MAX_SOCKET_PATH, (length, temp)
        assert temp.parent.parent == (base if length == 4 else Path("/tmp"))
        ray_setup.restore_local_env()
        if length != 4:
            base.rmdir()


def test_the_local_rays_sockets_and_logs_stay_behind_a_private_folder_during_a_survey(local_ray, shapes_survey):
    """Issue 62, item 13: the "private" folder was mode 0777 during a survey, and so were its ``sockets/`` and
    ``logs/`` (Ray's ``try_make_directory_shared`` chmods the folder it is given): another user planted a file and
    renamed the plasma store's socket, and the survey hung. Now, with the suite's local Ray up and a survey run on
    it, every path to its sockets and logs passes through a folder of the user's that no one else may enter (mode
    0700, the private folder Ray is given a folder inside of); Ray's socket paths fit ``RAY_SOCKET_TAIL``."""
    from vitlens.survey import ray_setup

    if os.environ.get("RAY_TMPDIR"):
        pytest.skip("RAY_TMPDIR set: Ray's folder is the user's choice")
    node = ray._private.worker._global_node
    temp = Path(node.get_temp_dir_path())
    private = temp.parent
    assert private.name.startswith(ray_setup.PRIVATE_PREFIX) and private.stat().st_uid == os.geteuid()
    assert private.stat().st_mode & 0o777 == 0o700
    sockets = [node.plasma_store_socket_name, node.raylet_socket_name]
    for path in [*map(Path, sockets), Path(node.get_sockets_dir_path()), Path(node.get_logs_dir_path())]:
        closed = [a for a in path.parents if a.stat().st_uid == os.geteuid() and not a.stat().st_mode & 0o077]
        assert closed and closed[-1] == private, (path, [oct(a.stat().st_mode) for a in path.parents])
    assert all(len(s) - len(str(temp)) <= ray_setup.RAY_SOCKET_TAIL for s in sockets), sockets


@pytest.mark.heavy  # conftest.HEAVY: handed out before the short tests
def test_a_local_survey_runs_its_ray_in_a_private_folder_and_removes_it(tmp_path):
    """A command-line survey with its own local Ray: the session ran under the survey's private temporary folder
    (not /tmp/ray), which is gone after; its logs are in OUT/logs, private. Its Ray has a CPU per core, so its model's
    two shards go to two worker processes where there are two cores (the suite's own Ray, tests/conftest.py, gives
    each model one). Its TMPDIR is 36 characters long: issue 62, item 12 (every local survey exited 1 from 33)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="vl-t-a-long-tmpdir-for-", dir="/tmp"))
    assert len(str(root)) == 36
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(TMPDIR=str(root), HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1",
                   PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        out = tmp_path / "zoo"
        proc = subprocess.run([sys.executable, "-m", "vitlens", "survey", "--models", "ref-vit", "--max-images", "4",
                               "--shard-size", "2", "--out", str(out), "--quiet"], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        entry = next(iter(vl.load_survey(out).manifest["models"].values()))
        replicas = min(2, os.cpu_count() or 1)
        assert entry["replicas"] == replicas and len({s["pid"] for s in entry["shards"].values()}) == replicas, entry
        left = [p.name for p in root.iterdir()]
        assert not [n for n in left if n.startswith("vitlens-ray-")] and "ray" not in left, left
        logs = out / vl.load_survey(out).manifest["ray"]["session_logs"]
        files = [p for p in logs.rglob("*") if p.is_file()]
        assert files and all(p.stat().st_mode & 0o777 == 0o600 for p in files)
        assert logs.stat().st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_an_out_that_is_not_a_survey_folder_is_refused_before_anything_is_written(tmp_path, capsys):
    """--out at another tool's folder (its own .lock in it) or at a folder of other files: refused, and the other
    tool's .lock is left as it was, none made where there was none (``--out /`` left ``/.lock``)."""
    other = tmp_path / "other-tool"
    other.mkdir()
    (other / ".lock").write_text("held by another tool")
    (other / "data.txt").write_text("x")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("y")
    for folder in (other, plain):
        with pytest.raises(InvalidParameterError, match="exists and is not a survey folder"):
            vl.survey(["ref-vit"], shapes_source(N), folder, shard_size=SHARD, progress=False)
    assert (other / ".lock").read_text() == "held by another tool" and not (plain / ".lock").exists()
    from vitlens.cli import main  # the command, in this process: refused before any Ray or model

    assert main(["survey", "--models", "ref-vit", "--n-images", "4", "--out", str(plain), "--quiet"]) != 0
    assert "is not a survey folder" in capsys.readouterr().err
    assert sorted(p.name for p in plain.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("kind", ["big", "fifo"])
def test_a_manifest_is_read_only_when_it_is_a_file_within_the_bound(tmp_path, monkeypatch, kind):
    """A manifest.json larger than the bound (a 1 GB one cost 2 GB to read) is refused from its size, before it is
    read; a FIFO under the name is refused without opening it."""
    from vitlens.survey import shard_store as store_module

    folder = tmp_path / "zoo"
    folder.mkdir()
    if kind == "big":
        monkeypatch.setattr(store_module, "MAX_MANIFEST_BYTES", 1000)
        (folder / "manifest.json").write_text('{"models": {}, "pad": "' + "x" * 2000 + '"}')
        said = "holds 2,0.. bytes, more than a survey manifest may \\(1,000\\); not read"
    else:
        os.mkfifo(folder / "manifest.json")
        said = "is not a regular file"
    with pytest.raises(InvalidParameterError, match=said):
        vl.load_survey(folder)


def test_a_model_that_read_no_image_has_failed_and_reports_draw_it(local_ray, tmp_path):
    """Every image unreadable: the model is failed with its reason (it was "done (0 images)", exit 0), and the
    report of the folder draws its tables as they are, empty (survey-report and the app's Survey page raised an
    IndexError)."""
    from vitlens.report.survey import summary_rows, survey_html

    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        (images / f"im{i}.png").write_bytes(b"not an image")
    out = tmp_path / "zoo"
    result = vl.survey(["ref-vit"], str(images), out, shard_size=SHARD, batch_size=4, progress=False)
    assert result.models() == [] and "no image could be read: 3 of 3 skipped as unreadable" in result.failed["ref-vit"]
    assert vl.load_survey(out).manifest["models"][next(iter(result.manifest["models"]))]["status"] == "failed"
    assert result.table.empty and "ref-vit" in survey_html(result)
    assert [row["status"] for row in summary_rows(result)] == ["failed"]
    with pytest.raises(Exception, match="--strict"):
        vl.survey(["ref-vit"], str(images), out, shard_size=SHARD, batch_size=4, progress=False, strict=True)


def test_a_survey_without_distance_draws_its_summary_as_empty(local_ray, tmp_path):
    """A model done with no distance rows (a weights-only survey, or a folder written before a model that read
    nothing was failed): its summary row has empty cells, no IndexError."""
    from vitlens.report.survey import summary_rows, survey_html

    result = vl.survey(["ref-vit"], shapes_source(4), tmp_path / "zoo", shard_size=SHARD, views=("weights",),
                       progress=False)
    rows = summary_rows(result)
    assert [r["model"] for r in rows] == ["ref-vit"] and np.isnan(rows[0]["depth ratio"])
    assert "ref-vit" in survey_html(result)


def test_a_survey_process_holds_one_model_and_drops_it_after_the_models_last_task(monkeypatch):
    """``worker.survey_task``'s rule, in this process: a task on the held model reuses it (loaded once), a task on
    another model replaces it (never two held), a task sent with ``keep`` false drops it when done, and a checkpoint
    is held under the digest the driver recorded (another digest loads again)."""
    import torch

    from vitlens.survey import worker

    monkeypatch.setattr(worker, "_HELD", {})
    loads: list[str] = []

    class Counting(worker.SurveyWorker):
        def _model(self):
            if self.m is None:
                loads.append(self.name)
            return super()._model()

    threads = torch.get_num_threads()  # survey_task sets the process's threads: left as they are
    vit, hybrid = ("ref-vit", False, None), ("ref-hybrid", False, None)
    assert worker.survey_task(Counting, vit, "load", threads, False, True)["ok"]
    assert worker.survey_task(Counting, vit, "weights", threads, False, True)
    assert loads == ["ref-vit"] and [key[1] for key in worker._HELD] == ["ref-vit"]
    assert worker.survey_task(Counting, hybrid, "load", threads, False, True)["ok"]
    assert loads == ["ref-vit", "ref-hybrid"] and [key[1] for key in worker._HELD] == ["ref-hybrid"]
    worker.survey_task(Counting, hybrid, "weights", threads, False, False)
    assert worker._HELD == {} and loads == ["ref-vit", "ref-hybrid"]
    worker.survey_task(Counting, ("ref-vit", False, "a" * 64), "load", threads, False, True)
    worker.survey_task(Counting, ("ref-vit", False, "b" * 64), "load", threads, False, True)
    assert loads == ["ref-vit", "ref-hybrid", "ref-vit", "ref-vit"] and len(worker._HELD) == 1
    assert torch.get_num_threads() == threads


def test_the_next_survey_of_a_session_runs_in_the_process_the_last_one_used(local_ray, tmp_path):
    """Shards are Ray tasks and Ray keeps its worker processes: a second survey from the same Python session (here
    of another model) computes its shards in the process that computed the first's, which imported torch once,
    rather than starting one per model (the suite's Ray has one CPU, so one process serves both)."""
    kw = dict(shard_size=SHARD, batch_size=4, views=("distance",), progress=False)
    first = vl.survey(["ref-vit"], shapes_source(N), tmp_path / "a", **kw)
    second = vl.survey(["ref-hybrid"], shapes_source(N), tmp_path / "b", **kw)

    def pids(result) -> set[int]:
        return {s["pid"] for e in result.manifest["models"].values() for s in e["shards"].values()}

    assert len(pids(first)) == 1 and pids(second) == pids(first)
    assert [len(e["shards"]) for e in first.manifest["models"].values()] == [N // SHARD]


def test_a_view_registered_in_the_driver_is_surveyed_by_its_workers(local_ray, tmp_path, monkeypatch):
    """Issue 62, item 14: a view registered in the driver and asked of a survey failed in the workers (``KeyError:
    'distance2'``: a Ray worker imports vitlens afresh and never saw the registration). The driver now sends its
    registered views with the tasks: the survey of a second distance view, registered here, finishes, with its rows
    in the table, equal to the built-in view's."""
    import dataclasses

    from vitlens.views import registry

    view = dataclasses.replace(registry.VIEWS["distance"], name="distance2", default=False)
    monkeypatch.setitem(registry.VIEWS, "distance2", view)  # the registration undone after the test
    registry.register_view(view, replace=True)
    assert registry.registered_views() == (view,)
    ours = vl.survey(["ref-vit"], shapes_source(N), tmp_path / "ours", shard_size=SHARD, views=("distance2",),
                     progress=False)
    builtin = vl.survey(["ref-vit"], shapes_source(N), tmp_path / "builtin", shard_size=SHARD, views=("distance",),
                        progress=False)
    assert ours.failed == {} and ours.models() == ["ref-vit"]
    assert len(ours.table) > 1 and ours.table.drop(columns="value").equals(builtin.table.drop(columns="value"))
    assert np.allclose(ours.table["value"], builtin.table["value"])


def test_a_registered_view_that_cannot_be_sent_is_refused_in_the_driver(local_ray, monkeypatch):
    """The other half of item 14: a registered view whose functions cannot be pickled (here its builder holds a
    lock) is refused in the driver, naming it, before any task is sent."""
    import dataclasses
    import functools

    from vitlens.survey.run import SurveyError, ship_registered_views
    from vitlens.views import registry

    held = functools.partial(registry.VIEWS["distance"].build, threading.Lock())
    view = dataclasses.replace(registry.VIEWS["distance"], name="distance_locked", build=held)
    monkeypatch.setitem(registry.VIEWS, "distance_locked", view)
    with pytest.raises(SurveyError, match=r"The views registered here \(distance_locked\) cannot be sent"):
        ship_registered_views(local_ray)
