"""Named sites: the one hook layer every analysis beside attention reads the model through (docs/definitions.md,
"Named sites").

A site is a tensor a forward computes at a module, named as TransformerLens names its hook points
(``blocks.3.hook_resid_pre``, ``blocks.3.attn.hook_z``, ``ln_final.hook_in``): a ``HookPoint`` says which module and
whether its input or output. What a model's modules are (which module is a block, its attention branch, its heads'
projection) is declared by the model's family (``Family.hook_points``: each block's residual stream in and out and
its heads before the projection, for every model a family reads) and, for the residual-sum models the component
analyses read, by their site map (``vitlens.components.layout``: the branches, queries and keys, final norm too). A
site a new analysis needs beside those is one ``register_site`` call in the module that needs it, and every map of
every model then has it (``hook_points``, ``family_sites``).

A ``SiteSession`` is a ``HookSession``: it holds the model's lock from install to removal and its hooks act only on
the owning thread's forwards, so two threads on one model never mix what their sites saw. Reading a site returns
nothing to the forward, so capture leaves the outputs bit-for-bit those of a run without it; an analysis that edits
a site (patching, ablation) says so by returning a new tensor.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..families.hook_session import Handles, HookSession
from ..families.sites import BLOCK_SITES, MODEL_SITES, HookPoint

OnSite = Callable[[str, Any], Any]
"""What a session does at each site it sees: ``on(name, value)``; returning None (or ``value`` itself) leaves the
forward as it was, returning another tensor puts it in the value's place."""


Locate = Callable[[nn.Module, Mapping[str, HookPoint]], Mapping[str, HookPoint]]
_REGISTERED: dict[str, Locate] = {}


def register_site(name: str, locate: Locate) -> str:
    """Register a named site beside the standard ones, in the module that reads it.

    Args:
        name: the site's name (``blocks.*.hook_attn_in``: a ``*`` stands for the block index).
        locate: ``locate(model, points) -> {name: HookPoint}``: where the site is on ``model``, given the points its
            map already declares (``points``: the standard sites, so a new one can be found next to them); an empty
            mapping where the model has no such site.

    Returns:
        ``name``, so that a module can keep it as a constant.
    """
    _REGISTERED[name] = locate
    return name


def unregister_site(name: str) -> None:
    """Forget a site ``register_site`` added (a test's own site)."""
    _REGISTERED.pop(name, None)


def hook_points(model: nn.Module, declared: Mapping[str, HookPoint]) -> dict[str, HookPoint]:
    """Every named site of ``model``: the ones its site map declares (``declared``: its family's ``hook_points``, or
    a component analysis's richer map) and every registered site found on it."""
    points = dict(declared)
    for locate in list(_REGISTERED.values()):
        points.update(locate(model, declared))
    return points


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]) else out


class SiteSession(HookSession):
    """Hooks at named sites for as long as the ``with`` block: each site's value goes to ``on(name, value)``, and a
    tensor ``on`` returns in its place replaces it in the forward (a tuple output keeps its other elements).

    Args:
        model: the model the sites belong to (its lock is held while the session is active; None: modules of no
            one model, no lock held).
        points: the sites, by name.
        on: what to do with each value (``OnSite``).
    """

    def __init__(self, model: nn.Module | None, points: Mapping[str, HookPoint], on: OnSite) -> None:
        self.model = model
        self.points = dict(points)
        self.on = on

    def install(self, handles: Handles) -> None:
        for name, point in self.points.items():
            if point.at == "input":
                handles.hook(point.module.register_forward_pre_hook(self._pre(name)))
            elif point.at == "output":
                handles.hook(point.module.register_forward_hook(self._post(name, point.whole)))
            else:
                raise ValueError(f"site {name!r}: at must be 'input' or 'output', not {point.at!r}")

    def _pre(self, name: str) -> Callable[..., Any]:
        def hook(_module: nn.Module, args: tuple) -> tuple | None:
            new = self.on(name, args[0])
            return None if new is None or new is args[0] else (new, *args[1:])
        return hook

    def _post(self, name: str, whole: bool) -> Callable[..., Any]:
        def hook(_module: nn.Module, _args: tuple, out: Any) -> Any:
            value = out if whole else _first(out)
            new = self.on(name, value)
            if whole or new is None or new is value:
                return None
            if value is out:
                return new
            return [new, *out[1:]] if isinstance(out, list) else (new, *out[1:])  # the other items kept
        return hook


def record(model: nn.Module, points: Mapping[str, HookPoint], run: Callable[[], Any]) -> tuple[dict[str, Any], Any]:
    """One forward (``run()``, under ``torch.no_grad``) with every site in ``points`` read, the forward untouched.

    Returns:
        ``(seen, out)``: each site's value by name, and what ``run`` returned.
    """
    seen: dict[str, Any] = {}

    def keep(name: str, value: Any) -> None:
        seen[name] = value

    with SiteSession(model, points, keep), torch.no_grad():
        out = run()
    return seen, out


def family_sites(m: Any) -> dict[str, HookPoint]:
    """Every named site of a ``LoadedModel`` ``m``: its family's (``Family.hook_points``) and the registered ones."""
    return hook_points(m.model, m.family.hook_points(m.model))


__all__ = ["BLOCK_SITES", "MODEL_SITES", "HookPoint", "OnSite", "SiteSession", "family_sites", "hook_points", "record",
           "register_site", "unregister_site"]
