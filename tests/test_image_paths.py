"""Image sets named by folders and globs under symlink loops (issue 33, item 5): each file once, loops not
followed, and the call returns."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

from vitlens.images import find_image_files


def _looped(tmp_path: Path, loops: int) -> Path:
    folder = tmp_path / "imgs"
    (folder / "sub").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    Image.new("RGB", (8, 8)).save(folder / "sub" / "b.png")
    for name in ("self", "again")[:loops]:
        os.symlink(".", folder / name)
    return folder


def test_one_symlink_loop_lists_each_file_once(tmp_path):
    folder = _looped(tmp_path, 1)
    files = find_image_files(f"{folder}/**/*.png")
    assert files == [folder / "a.png", folder / "sub" / "b.png"]
    assert find_image_files(str(folder), recursive=True) == files


def test_two_symlink_loops_return_at_once(tmp_path):
    folder = _looped(tmp_path, 2)
    code = ("import sys; from vitlens.images import find_image_files; "
            "print(len(find_image_files(sys.argv[1])))")
    proc = subprocess.run([sys.executable, "-c", code, f"{folder}/**/*.png"], capture_output=True, text=True,
                          timeout=30, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 0 and proc.stdout.strip() == "2", proc.stderr


def test_a_symlinked_file_is_counted_once_with_its_target(tmp_path):
    folder = _looped(tmp_path, 0)
    os.symlink(folder / "a.png", folder / "alias.png")
    assert find_image_files(f"{folder}/*.png") == [folder / "a.png"]
