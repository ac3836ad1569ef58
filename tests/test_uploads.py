"""Uploaded checkpoints (issue 33, item 7): a private folder per server and per session (0700), nothing planted
there is ever read, and the files go when the session or the server ends."""
from __future__ import annotations

import gc
import hashlib
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vitlens.loading.checkpoint import CHECKPOINT_SUFFIXES
from vitlens_app.uploads import CHECKPOINT_TYPES, UPLOAD_SUFFIXES, UploadFolder, server_folder

ROOT = Path(__file__).resolve().parents[1]


def test_the_folders_are_private_and_fresh():
    folder = UploadFolder()
    try:
        for p in (server_folder(), folder.path):
            assert stat.S_IMODE(p.stat().st_mode) == 0o700 and p.stat().st_uid == os.getuid()
        assert folder.path.parent == server_folder() and server_folder().name != "vitlens-uploads"
        saved = folder.save("w.safetensors", b"weights")
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600 and saved.read_bytes() == b"weights"
        assert saved.suffix == ".safetensors"
    finally:
        folder.close()
    assert not folder.path.exists()


def test_every_checkpoint_suffix_the_loader_reads_is_uploaded_and_kept():
    """The uploader takes, and the upload folder keeps, every suffix the loader reads as a checkpoint (``.tar``
    included: a torch.save archive), from the loader's one list."""
    assert set(CHECKPOINT_TYPES) == {s.lstrip(".") for s in CHECKPOINT_SUFFIXES} and ".tar" in CHECKPOINT_SUFFIXES
    assert set(CHECKPOINT_SUFFIXES) <= set(UPLOAD_SUFFIXES)
    folder = UploadFolder()
    try:
        assert folder.save("weights.TAR", b"w").suffix == ".tar"
        assert folder.save("notes.txt", b"n").suffix == ""
    finally:
        folder.close()


def test_a_planted_file_or_link_under_the_uploads_name_is_replaced_not_read(tmp_path):
    folder = UploadFolder()
    try:
        data = b"the good weights"
        name = hashlib.sha256(data).hexdigest()[:32] + ".safetensors"
        (folder.path / name).write_bytes(b"NaN weights planted here")
        assert folder.save("good.safetensors", data).read_bytes() == data
        outside = tmp_path / "elsewhere.safetensors"
        outside.write_bytes(b"someone else's file")
        (folder.path / name).unlink()
        os.symlink(outside, folder.path / name)
        saved = folder.save("good.safetensors", data)
        assert not saved.is_symlink() and saved.read_bytes() == data
        assert outside.read_bytes() == b"someone else's file"  # never written through the link
    finally:
        folder.close()


def test_the_session_folder_goes_with_the_session_and_the_server_folder_at_exit():
    folder = UploadFolder()
    path = folder.path
    folder.save("a.pth", b"x")
    del folder
    gc.collect()
    assert not path.exists()
    code = ("from vitlens_app.uploads import UploadFolder, server_folder\n"
            "f = UploadFolder(); f.save('a.bin', b'junk'); print(server_folder())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and not Path(proc.stdout.strip()).exists()


def test_the_app_reads_its_upload_not_a_file_planted_at_the_old_shared_path(tmp_path):
    pytest.importorskip("streamlit")
    from safetensors.torch import save_file
    from streamlit.testing.v1 import AppTest

    import vitlens as vl

    m = vl.load_model("ref-vit", device="cpu")
    good = tmp_path / "good.safetensors"
    save_file({k: v.contiguous() for k, v in m.model.state_dict().items()}, str(good))
    data = good.read_bytes()
    shared = Path(tempfile.gettempdir()) / "vitlens-uploads"
    planted = shared / f"{hashlib.sha256(data).hexdigest()[:16]}.safetensors"
    try:  # what the attacker did: pre-create the shared folder and plant junk under the upload's old name
        shared.mkdir(exist_ok=True)
        planted.write_bytes(b"planted NaN weights")
    except OSError:
        planted = None
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.run()
    at.radio(key="m1-source").set_value("Checkpoint").run()
    at.text_input(key="m1-arch").set_value("ref-vit").run()
    at.file_uploader(key="m1-ckpt").set_value(("good.safetensors", data, "application/octet-stream")).run()
    assert not at.exception and not at.error
    folder = at.session_state["upload-folder"].path
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder != shared and shared not in folder.parents
    (saved,) = list(folder.iterdir())
    assert saved.read_bytes() == data
    if planted is not None:
        assert saved != planted and planted.read_bytes() == b"planted NaN weights"
        planted.unlink()
