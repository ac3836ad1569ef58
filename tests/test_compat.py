"""Code written against earlier versions keeps working: old module paths, the accumulators'
old call style, dict-style access to the spec, and result files that stored the spec as a dict."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import vitlens as vl

ROOT = Path(__file__).resolve().parents[1]


def test_old_module_paths_still_import_the_same_objects():
    code = """
import vitlens.shapes, vitlens.model
from vitlens.shapes import generate, HELD_OUT_SEED
from vitlens.model import load_model, LoadedModel, ModelSpec
from vitlens.capture import capture_attention, attention_probs
from vitlens.analyze import stream_attention, attention_distance
from vitlens.faithfulness import compare_methods, deletion_insertion, ComparisonTable
from vitlens.metrics import mask_scores, patch_coverage
from vitlens.evaluation import accuracy, rollout_mask_scores
from vitlens.presets import PRESETS, list_models
from vitlens.hub import resolve_pretrained_source
from vitlens.checkpoint import load_checkpoint_into
from vitlens.cli import main
from vitlens.attribution import attribute, METHODS
from vitlens.report import ReportData, ComparisonData, layer_table
import vitlens as vl
from vitlens.reference.shapes import generate as new_generate
assert generate is new_generate and vitlens.shapes.generate is new_generate
assert load_model is vl.load_model and callable(vl.analyze)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_accumulators_still_take_the_old_calls(tiny):
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), vl.capture_attention(tiny, mode="inline") as cap:  # the maps the views use
        tiny.model(x)
    s = tiny.spec
    acc = vl.AttentionDistanceAccumulator(s.num_layers, s.num_heads, s.num_prefix_tokens, s.stride_px, True)
    roll = vl.RolloutAccumulator(s.num_layers, s.num_prefix_tokens, s.has_class_token)
    acc.begin_batch(s.grid, s.image_size, torch.device("cpu"))
    roll.begin_batch(s.grid, s.image_size, torch.device("cpu"))
    for layer, a in enumerate(cap.maps):
        acc(layer, a)
        roll(layer, a)
    maps = roll.end_batch()
    assert acc.result(s.name).equals(vl.attention_distance(tiny, x), rtol=1e-12)
    np.testing.assert_allclose(maps, vl.attention_rollout(tiny, x).maps, rtol=1e-12)


def test_an_analysis_saved_with_the_spec_as_a_dict_loads_with_a_model_spec(tmp_path, tiny):
    r = vl.analyze(tiny, torch.randn(1, 3, 224, 224), n_components=3)
    path = r.save(tmp_path / "a.json")
    data = json.loads(path.read_text())
    data["spec"] = data["spec"]["__spec__"]  # as earlier versions wrote it
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    back = vl.load_result(old)
    assert isinstance(back.spec, vl.ModelSpec) and back.spec == tiny.spec
    assert back.spec["name"] == back.spec.name == "vit_tiny_patch16_224"
    assert back.equals(r)
