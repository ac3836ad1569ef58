"""The MLP of a timm ViT block computed in the capture session's workspace (issue 52, the cold call):
``vitlens.families.timm_vit.mlp_in_workspace`` must be the module's own forward to the bit, reuse its buffers, give way
to the module wherever a hook, gradients or dropout could see a difference, and leave every view's numbers as they
were."""
from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from torch import nn

import vitlens as vl
from vitlens.core.attention import PROBS_BUFFER, QKV_BUFFER
from vitlens.families import timm_vit
from vitlens.families.base import Handles


def _model(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, **kwargs).eval()


def test_the_workspace_mlp_is_the_modules_forward_bit_for_bit_and_reuses_its_buffers():
    """Every block's MLP under the session equals the class's forward to the bit (1 and 2 threads), its hidden
    activation and output live in the workspace's two buffers (the same memory block after block), and removing the
    session gives the module its own forward back."""
    model = _model()
    threads = torch.get_num_threads()
    handles, ws = Handles(), {}
    timm_vit.mlp_in_workspace(model.blocks, ws, handles)
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for i, block in enumerate(model.blocks):
                x = torch.randn(3, 17, 192, generator=torch.Generator().manual_seed(10 * n + i))
                with torch.no_grad():
                    want = type(block.mlp).forward(block.mlp, x)
                    got = block.mlp(x)
                assert torch.equal(got, want)
                assert got.data_ptr() == ws[QKV_BUFFER].data_ptr()
                assert ws[PROBS_BUFFER].numel() >= 3 * 17 * 768
    finally:
        torch.set_num_threads(threads)
        handles.remove()
    assert all("forward" not in vars(block.mlp) for block in model.blocks)


def test_the_module_runs_itself_wherever_a_difference_could_be_seen():
    """Wherever a difference could be seen, the module's own forward runs (its activation module is called, which the
    workspace path never calls): a hook on a module of the block (it may keep what it sees: a forward hook, a
    pre-hook), a global hook, gradients (and the backward works, with the class forward's gradients), autocast and
    dropout in training. Without any of them the workspace path runs (the activation module is not called)."""
    model = _model(proj_drop_rate=0.5)  # the dropouts of each MLP: nn.Dropout(0.5)
    block = model.blocks[0]
    assert block.mlp.drop1.p == 0.5
    calls: list[int] = []
    act_forward = block.mlp.act.forward
    block.mlp.act.forward = lambda x: (calls.append(1), act_forward(x))[1]  # counts the activation module's calls
    handles, ws = Handles(), {}
    timm_vit.mlp_in_workspace(model.blocks, ws, handles)
    x = torch.randn(2, 5, 192)

    def act_ran(run) -> bool:
        calls.clear()
        with torch.no_grad():
            run()
        return len(calls) == 1

    try:
        assert not act_ran(lambda: block.mlp(x)) and QKV_BUFFER in ws  # no hook, eval: the workspace path
        for hook in (block.mlp.act.register_forward_hook(lambda *_: None),
                     block.mlp.fc2.register_forward_pre_hook(lambda *_: None),
                     block.ls2.register_forward_hook(lambda *_: None),
                     nn.modules.module.register_module_forward_hook(lambda *_: None)):
            assert act_ran(lambda: block.mlp(x))
            hook.remove()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert act_ran(lambda: block.mlp(x))
        calls.clear()
        xg = x.clone().requires_grad_()
        out = block.mlp(xg)
        assert len(calls) == 1 and out.requires_grad
        out.square().sum().backward()
        xw = x.clone().requires_grad_()
        type(block.mlp).forward(block.mlp, xw).square().sum().backward()
        assert torch.equal(xg.grad, xw.grad)
        block.mlp.train()
        assert act_ran(lambda: block.mlp(x))  # dropout in training: the module's own random mask
        block.mlp.eval()
        assert not act_ran(lambda: block.mlp(x))
    finally:
        handles.remove()
        del block.mlp.act.forward


def test_other_mlps_keep_their_forward():
    """A gated MLP (SwiGLU) and an MLP with another activation (SiLU): other computations, not replaced."""
    from timm.layers import Mlp, SwiGLUPacked

    gated, silu = _model(mlp_layer=SwiGLUPacked, act_layer=nn.SiLU), _model(act_layer=nn.SiLU)
    assert type(gated.blocks[0].mlp).__name__ == "GluMlp" and type(silu.blocks[0].mlp) is Mlp
    for model in (gated, silu):
        handles = Handles()
        timm_vit.mlp_in_workspace(model.blocks, {}, handles)
        assert all("forward" not in vars(block.mlp) for block in model.blocks)
        handles.remove()


def test_the_views_numbers_are_those_of_the_modules_own_mlp(monkeypatch):
    """``vl.analyze`` (distance and rollout, inline capture by rows: where the MLPs run in the workspace) gives the
    same numbers to the bit as with the modules' own MLPs."""
    m = vl.load_model("vit_tiny_patch16_224", pretrained=False, img_size=96)
    x = torch.randn(3, 3, 96, 96, generator=torch.Generator().manual_seed(3))
    real, sessions = timm_vit.mlp_in_workspace, []

    def spy(blocks, workspace, handles):
        sessions.append(workspace)
        real(blocks, workspace, handles)

    monkeypatch.setattr(timm_vit, "mlp_in_workspace", spy)
    got = vl.analyze(m, x, views=("distance", "rollout"), memory_budget_mb=0.01)  # blocks of a few query rows
    # the MLPs ran in the session's workspace: its probabilities' buffer grew to a hidden activation [3, 37, 768]
    assert len(sessions) == 1 and sessions[0][PROBS_BUFFER].numel() >= 3 * 37 * 768
    monkeypatch.setattr(timm_vit, "mlp_in_workspace", lambda *_: None)
    want = vl.analyze(m, x, views=("distance", "rollout"), memory_budget_mb=0.01)
    np.testing.assert_array_equal(got.distance.mean_px, want.distance.mean_px)
    np.testing.assert_array_equal(got.rollout.maps, want.rollout.maps)


def test_the_bench_times_the_views_own_cost_over_the_buffered_forward(tmp_path, capsys):
    """``analyses/bench.py --rows distance_rollout plain_mlp_buffers`` (in-process, a small model, one repetition):
    both rows timed, and the ratio of the one to the other reported and printed."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "analyses" / "bench.py"
    spec = importlib.util.spec_from_file_location("bench_rows", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--model", "vit_tiny_patch16_224", "--img-size", "64", "--batch", "2", "--reps", "1",
                       "--skip-memory", "--rows", "distance_rollout", "plain_mlp_buffers",
                       "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())["speed"]
    assert set(out["runs_seconds"]) == {"plain_forward", "plain_again", "distance_rollout", "plain_mlp_buffers"}
    own = out["ratios"]["distance_rollout / plain_mlp_buffers"]
    (a,), (b,) = out["runs_seconds"]["distance_rollout"], out["runs_seconds"]["plain_mlp_buffers"]
    # the reported times are rounded to the millisecond (0.0005 s each), the ratio to three places
    assert own == pytest.approx(a / b, rel=0.0005 / a + 0.0005 / b + 1e-6, abs=0.0005)
    assert f"the views' own cost, distance + rollout over the plain forward with the MLP's buffers: {own:.3f}" \
        in capsys.readouterr().out
