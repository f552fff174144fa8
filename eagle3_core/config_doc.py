"""docs/configuration.md, generated from the configuration's pydantic models (their field types, defaults and
descriptions), so the document cannot drift from the code: `python -m eagle3_core.config_doc > docs/configuration.md`
writes it, and tests/unit/test_config_doc.py fails when the file is not what this prints."""

from __future__ import annotations

import inspect
import sys
import types
import typing
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from eagle3_core.config import Eagle3Config

HEADER = """# Configuration (`eagle3.yaml`)

Generated from `eagle3_core/config.py` by `python -m eagle3_core.config_doc > docs/configuration.md`; a test fails
when this file and the code differ. Every field is optional unless marked required; an unknown field or an
invalid value is refused in one line naming the field (a number must be finite: `.inf` and `.nan` are
refused). Relative paths resolve against the YAML file.
"""


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(get_args(annotation)[0])
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in get_args(annotation))
    if origin in (list, tuple, dict):
        args = ", ".join(_type_name(a) for a in get_args(annotation) if a is not Ellipsis)
        return f"{origin.__name__}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
        return "(see below)" if isinstance(value, BaseModel) else f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "required"
    if isinstance(field.default, BaseModel):
        return "(see below)"
    return f"`{field.default!r}`"


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's type names (itself, inside a list, or in a union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models(a)]


def _section(path: str, model: type[BaseModel], seen: set[type[BaseModel]]) -> list[str]:
    doc = " ".join(inspect.cleandoc(model.__doc__ or "").split("\n\n")[0].split())  # one line, unindented
    lines = [f"## `{path}` ({model.__name__})" if path else "## top level", ""]
    if doc:
        lines += [doc, ""]
    lines += ["| field | type | default | what it is |", "|---|---|---|---|"]
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        description = (field.description or "").replace("\n", " ").replace("|", "\\|")
        lines.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {description} |")
        for sub in _models(field.annotation):
            if sub not in seen:
                seen.add(sub)
                list_of = get_origin(field.annotation) is list
                nested.append(((f"{path}.{name}" if path else name) + ("[]" if list_of else ""), sub))
    lines.append("")
    for sub_path, sub in nested:
        lines += _section(sub_path, sub, seen)
    return lines


def configuration_doc() -> str:
    return HEADER + "\n" + "\n".join(_section("", Eagle3Config, {Eagle3Config})).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(configuration_doc())
