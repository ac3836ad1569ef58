"""Families as plug-ins (issue 44, item 2): a family module imports the helper layer (``vitlens.families.common``) and
``base``, never another family's module, and no private name crosses modules; a Hugging Face family declares its own
model types, processor defaults and attention implementation, and what used to be hand-kept lists is derived from the
registered families; the optional abilities are declared on ``Family`` and no caller reads them with ``getattr``;
every "Supported: ..." message is generated from the registry."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from torch import nn

import vitlens as vl
from vitlens.families import FAMILIES, Family, family_of
from test_import_graph import import_graph

ROOT = Path(__file__).resolve().parents[1]
FAMILIES_DIR = ROOT / "vitlens" / "families"


def _family_modules() -> set[str]:
    """The modules that register a family (every registered family's class's module)."""
    return {type(f).__module__ for f in FAMILIES}


class _Toy(Family):
    """A family of no model (``matches`` is False): registered for a test, then removed."""

    name = "toy-striped"
    summary = "toy striped-attention ViTs (a test's own family)"

    def matches(self, model: nn.Module) -> bool:
        return False


class _Registered:
    """``with _Registered(family):`` the family is in ``FAMILIES`` (before the fallback), and removed after."""

    def __init__(self, family: Family) -> None:
        self.family = family

    def __enter__(self) -> Family:
        FAMILIES.insert(len(FAMILIES) - 1, self.family)
        return self.family

    def __exit__(self, *exc: object) -> None:
        FAMILIES.remove(self.family)


def test_no_family_module_imports_another_family_module():
    family_modules = _family_modules()
    assert {"vitlens.families.swin", "vitlens.families.hf", "vitlens.families.timm_vit"} <= family_modules
    edges = import_graph()
    crossing = {m: sorted(t for t in targets if t in family_modules and t != m)
                for m, targets in edges.items()
                if m.startswith("vitlens.families.") and m != "vitlens.families"}  # the package imports them all
    assert {m: t for m, t in crossing.items() if t} == {}, "family modules import only base and the helper layer"
    # the helper layer is below every family: it names no family module, and it registers no family
    assert all(not m.startswith("vitlens.families.common") for m in family_modules)


def test_no_private_name_crosses_a_module_of_the_families():
    crossing = []
    for path in sorted((ROOT / "vitlens").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and ("families" in (node.module or "")
                                                    or path.is_relative_to(FAMILIES_DIR)):
                crossing += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name.startswith("_")
                             and a.name != "__future__"]
    assert crossing == []


def _refusal(make) -> str:
    with pytest.raises(vl.UnsupportedModelError) as err:
        family_of(make())
    return str(err.value)


def _xcit() -> nn.Module:
    import timm

    return timm.create_model("xcit_nano_12_p16_224", pretrained=False, img_size=32, depth=1)


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())


@pytest.mark.parametrize("make", [_xcit, _cnn], ids=["refused-by-name", "not-a-vit"])
def test_the_supported_families_messages_name_every_registered_family(make):
    from vitlens.families import supported_families

    message = _refusal(make)
    assert ("Supported: " in message) if make is _xcit else ("not a Vision Transformer" in message)
    assert all(f.summary and f.summary in message for f in FAMILIES), "every family says what it reads"
    for words in ("Swin", "Hiera", "MViT v2", "PVT", "SAM", "ViTDet", "CaiT"):  # missing from the hand-written text
        assert words in message
    with _Registered(_Toy()):  # a family registered is named there, without touching another file
        assert _Toy.summary in _refusal(make) and _Toy.summary in supported_families()
    assert _Toy.summary not in _refusal(make)


#: the abilities some families have and the others not, declared on ``Family`` (None: the family has none)
OPTIONAL = ("windows", "stage_layout", "block_heads", "block_layout", "hf_types")


def test_the_optional_abilities_are_declared_on_family_with_none_as_their_default():
    for ability in OPTIONAL:
        assert ability in vars(Family) and getattr(Family, ability) is None, ability
    assert Family.cam_layer(Family(), nn.Identity()) is None
    swin = next(f for f in FAMILIES if f.name == "timm-swin")
    assert all(callable(getattr(swin, a)) for a in ("windows", "stage_layout", "block_heads"))
    assert swin.block_layout is None and swin.hf_types is None


def _callers() -> list[Path]:
    """What reads the families from outside them: the library, the analyses and the app."""
    return ([p for p in sorted((ROOT / "vitlens").rglob("*.py")) if not p.is_relative_to(FAMILIES_DIR)]
            + sorted((ROOT / "analyses").glob("*.py")) + [ROOT / "app.py"]
            + sorted((ROOT / "vitlens_app").rglob("*.py")))


def _is_family(node: ast.expr) -> bool:
    """Whether an expression is a family: ``family``, ``fam``, ``x.family``, ``m.family`` ..."""
    return (isinstance(node, ast.Name) and node.id in ("family", "fam")) or \
        (isinstance(node, ast.Attribute) and node.attr == "family")


def test_no_caller_reads_a_family_ability_with_getattr_and_every_one_it_reads_is_declared():
    by_getattr, undeclared = [], []
    for path in _callers():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "hasattr") and node.args and _is_family(node.args[0]):
                by_getattr.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Attribute) and _is_family(node.value) and not hasattr(Family, node.attr):
                undeclared.append(f"{path.relative_to(ROOT)}:{node.lineno}: family.{node.attr}")
    assert by_getattr == [], "an optional ability is declared on Family: read it as family.<ability>"
    assert undeclared == [], "callers read only what Family declares"


def test_a_hugging_face_familys_facts_are_its_own_and_the_lists_derive_from_the_registry():
    from vitlens.families.common import hf as common_hf

    hf_vit = next(f for f in FAMILIES if f.name == "hf-vit")
    others = {t for f, types in common_hf.declarations() if f is not hf_vit for t in types.processors}
    assert {"swin", "swinv2", "hiera", "vitdet", "sam_vision_model", "pvt", "pvt_v2", "dinov3_vit"} <= others
    source = (FAMILIES_DIR / "hf.py").read_text()
    assert [t for t in sorted(others) if f'"{t}"' in source] == [], "hf.py holds no other family's model types"
    for name in ("PROCESSOR_DEFAULTS", "PYRAMID_TYPES", "OWN_FAMILY_TYPES", "WINDOWED_TYPES", "TOWER_TYPES"):
        assert not hasattr(vl.families.hf, name)
    # what the loader asks for, from each family's declaration (PVT: its one eager implementation; Swin: sdpa)
    assert common_hf.implementation_request("pvt") == {} and common_hf.implementation_request("clip") == {}
    assert common_hf.implementation_request("swin") == {"attn_implementation": "sdpa"}
    assert common_hf.implementation_request("no_such_type") == {"attn_implementation": "sdpa"}  # the generic capture

    class ToyHf(_Toy):
        name = "hf-toy"
        summary = "Hugging Face toy towers"
        hf_types = common_hf.HfTypes(
            processors={"toy_vision_model": common_hf.ProcessorDefaults("center", 0.9, (0.1,) * 3, (0.2,) * 3,
                                                                        "bicubic")},
            towers={"toy": "toy_vision_model"}, attn_implementation=None)

    assert common_hf.reader_of("toy_vision_model") is None
    with _Registered(ToyHf()) as toy:  # one module's declaration, read everywhere
        assert common_hf.reader_of("toy_vision_model") is toy
        assert "toy_vision_model" in common_hf.types_read_elsewhere(hf_vit)  # hf-vit leaves it to its family
        assert common_hf.tower_types()["toy"] == "toy_vision_model"
        assert common_hf.implementation_request("toy") == {}
        from vitlens.loading.external import sdpa_request

        assert sdpa_request(type("Config", (), {"model_type": "toy"})()) == {}
        config = common_hf.processor_data_config({}, "toy")
        assert (config["mean"], config["std"], config["interpolation"]) == ((0.1,) * 3, (0.2,) * 3, "bicubic")
    assert "toy_vision_model" not in common_hf.types_read_elsewhere(hf_vit)
    assert common_hf.implementation_request("toy") == {"attn_implementation": "sdpa"}
