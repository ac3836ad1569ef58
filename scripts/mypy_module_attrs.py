"""mypy plugin: a submodule or parameter that a torch Module holds is read as `Any`, not `Tensor | Module`.

torch types `nn.Module.__getattr__` (the look-up of `_parameters`, `_buffers` and `_modules`) as returning
`Tensor | Module`, so every `model.blocks[i].attn.qkv(x)` of a model vitlens reads by its layout (timm,
Hugging Face, OpenCLIP, torchvision: duck typing, checked at run time by the family that claims the model)
is an error to mypy, although which of the two the attribute is follows from the library's layout, not from
torch. This plugin makes exactly that look-up `Any`: attributes a class declares (`training`, `forward`,
annotated fields of our own modules) and every other check (None, argument types, returns) are untouched.
Configured in pyproject.toml ([tool.mypy] plugins).
"""

from __future__ import annotations

from typing import Callable

from mypy.plugin import AttributeContext, Plugin
from mypy.types import AnyType, Instance, Type, TypeOfAny, UnionType, get_proper_type

_MODULE = "torch.nn.modules.module.Module"
_GETATTR_RESULT = {"torch._tensor.Tensor", _MODULE}


def _getattr_to_any(ctx: AttributeContext) -> Type:
    default = get_proper_type(ctx.default_attr_type)
    if isinstance(default, UnionType):
        names = {getattr(get_proper_type(t), "type", None) for t in default.items}
        if all(isinstance(get_proper_type(t), Instance) for t in default.items) and {
            n.fullname for n in names if n is not None
        } == _GETATTR_RESULT:
            return AnyType(TypeOfAny.special_form)
    return ctx.default_attr_type


class ModuleAttrsPlugin(Plugin):
    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        # mypy names the class that defines __getattr__ for an undeclared attribute: torch's Module
        if fullname.startswith(_MODULE + "."):
            return _getattr_to_any
        return None


def plugin(version: str) -> type[Plugin]:
    return ModuleAttrsPlugin
