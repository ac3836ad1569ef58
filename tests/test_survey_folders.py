"""Survey folders read as the shard store reads them (issue 62, items 10 and 11): a shard's place is ``lstat``-ed
and its size compared with its record before any byte is read, only regular files are opened, and the table's
row count is bounded from its Parquet metadata before it is decoded. Each attack replayed on a copy of the suite's
small survey folder (conftest's ``shapes_survey``); the memory ones in a child process, measured against a bound."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import vitlens as vl
from vitlens.survey.store import DamagedShardError, DamagedSurveyWarning, table_row_bound

ROOT = Path(__file__).resolve().parents[1]

#: a child process's script: load the folder (and ask for ref-vit's distance), under an address-space limit of
#: ``argv[2]`` MiB above what its imports took; prints what happened and how far its peak memory grew
CHILD = """
import json, resource, sys, warnings
import pandas, pyarrow.parquet, torch  # mapped before the limit: what a survey's reading needs besides the files
import vitlens as vl
import vitlens.survey.store
status = open("/proc/self/status").read()
vm = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize:"))) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[2]) * 2**20, resource.RLIM_INFINITY))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
try:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = vl.load_survey(sys.argv[1])
    out["warned"] = [str(w.message) for w in caught]
    out["damaged"] = result.damaged
    result.distance("ref-vit")
except Exception as e:
    out["error"] = [type(e).__name__, str(e)[:2000]]
out["grown_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
print(json.dumps(out))
"""


def _in_child(folder: Path, limit_mb: int = 512) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(limit_mb)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture()
def folder(shapes_survey, tmp_path) -> Path:
    out, _ = shapes_survey
    copy = tmp_path / "zoo"
    shutil.copytree(out, copy)
    return copy


def _shard(folder: Path, index: int = 1) -> Path:
    return next((folder / "shards").glob(f"ref-vit-*/shard-{index:05d}.npz"))


def test_a_sparse_file_in_a_shards_place_is_named_by_its_size_and_never_read(folder):
    """Item 10: a 4 GB sparse file (no bytes on disk) in a shard's place was read whole (4.7 GB, 85 s) before its
    size was compared with its record. Scaled down to 1 GiB: named "longer than written" from ``lstat``, and the
    child's peak memory grows by less than 64 MiB (it would be the file's 1 GiB, past the 512 MiB limit)."""
    shard = _shard(folder)
    shard.unlink()
    with open(shard, "wb") as f:
        f.truncate(2**30)
    out = _in_child(folder)
    assert out["damaged"]["ref-vit"]["shard-00001"].startswith(f"longer than written ({2**30} of ")
    assert out["error"][0] == "DamagedShardError" and "longer than written" in out["error"][1]
    assert out["grown_mb"] < 64, out


def test_a_link_to_dev_zero_in_a_shards_place_is_named_and_never_opened(folder):
    """Item 10: a link to ``/dev/zero`` named like a shard was read until MemoryError. Now it is named as a link,
    the folder still loads, and the child's memory does not grow."""
    shard = _shard(folder)
    shard.unlink()
    shard.symlink_to("/dev/zero")
    out = _in_child(folder)
    assert out["damaged"]["ref-vit"] == {"shard-00001": "is a symbolic link, not a regular file"}
    assert out["error"][0] == "DamagedShardError" and "is a symbolic link, not a regular file" in out["error"][1]
    assert out["grown_mb"] < 64, out


def test_a_fifo_in_a_shards_place_is_named_and_never_opened(folder):
    """Item 10: a FIFO named like a shard hung ``load_survey(...).distance(...)`` (opening it waits for a writer).
    Now the folder loads, names it, and asking for the distance says it is damaged, in well under the time limit."""
    shard = _shard(folder, 2)
    shard.unlink()
    os.mkfifo(shard)
    done: dict = {}

    def load() -> None:
        with pytest.warns(DamagedSurveyWarning, match=r"shard-00002 \(is a FIFO, not a regular file\)"):
            result = vl.load_survey(folder)
        done["damaged"] = result.damaged
        with pytest.raises(DamagedShardError, match=r"shard-00002.npz is damaged: is a FIFO, not a regular file"):
            result.distance("ref-vit")
        done["ok"] = True

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():  # the old code blocks in open(): a writer lets it go before the test fails
        with open(shard, "wb"):
            pass
        reader.join(timeout=30)
    assert done.get("ok") and done["damaged"]["ref-vit"] == {"shard-00002": "is a FIFO, not a regular file"}, done


def test_a_small_table_of_millions_of_rows_is_refused_from_its_metadata(folder):
    """Item 11: a 1.2 MB ``table.parquet`` of 40 M constant rows took ``vl.load_survey`` to 7.35 GB (no row bound).
    Scaled down to 2 M rows (a few kB on disk): refused from its metadata, naming the rows and the manifest's bound,
    with the child's peak memory below 64 MiB of growth (decoding it takes hundreds)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 2_000_000
    manifest = json.loads((folder / "manifest.json").read_text())
    bound = table_row_bound(manifest)
    assert bound < n
    columns = {"model": pa.repeat("ref-vit", n), "weights": pa.repeat("embedded", n), "layer": pa.repeat(1, n),
               "head": pa.repeat(1, n), "metric": pa.repeat("mean_distance", n), "value": pa.repeat(1.0, n),
               "n_images": pa.repeat(20, n), "class": pa.repeat("circle", n), "stage": pa.nulls(n, pa.int64())}
    pq.write_table(pa.table(columns), folder / "table.parquet", compression="zstd")
    assert (folder / "table.parquet").stat().st_size < 200_000
    out = _in_child(folder)
    assert out["error"][0] == "InvalidParameterError"
    assert f"declares {n:,} rows, more than its manifest's models and classes can have ({bound:,})" in out["error"][1]
    assert out["grown_mb"] < 64, out


def test_a_folders_own_table_is_within_its_bound_and_reads_whole(folder):
    """The bound is far above what a survey writes: the folder's own table reads, every row of it."""
    import pyarrow.parquet as pq

    manifest = json.loads((folder / "manifest.json").read_text())
    rows = pq.ParquetFile(folder / "table.parquet").metadata.num_rows
    assert 0 < rows * 4 < table_row_bound(manifest)
    assert len(vl.load_survey(folder).table) == rows


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_table_that_is_not_a_regular_file_is_refused_before_it_is_opened(folder, kind):
    """The table's place holding a FIFO or a link (to ``/dev/zero``) is named, not opened (a FIFO would hang)."""
    table = folder / "table.parquet"
    table.unlink()
    os.mkfifo(table) if kind == "fifo" else table.symlink_to("/dev/zero")
    what = "a FIFO" if kind == "fifo" else "a symbolic link"
    with pytest.raises(vl.InvalidParameterError, match=f"table.parquet is {what}, not a regular file"):
        vl.load_survey(folder)
