"""The YAML config loader: a recipe file and `--set a.b=c` overrides, validated into a dataclass tree.

Every config of the project goes through it (training's `train/config.py`, the batch and evaluation jobs'
`batch/config.py` and `batch/evaluate.py`, the engine's and moderation's settings nested in them), so
types, unknown keys, malformed YAML and `--set` are reported the same way everywhere, naming the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the fix."""


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check and convert one YAML value against a field's type annotation."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        if value not in typing.get_args(annotation):
            choices = ", ".join(repr(choice) for choice in typing.get_args(annotation))
            raise ConfigError(f"{where} must be one of {choices}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(annotation)
        if value is None and type(None) in arms:
            return None
        errors = []
        for arm in arms:
            if arm is type(None):
                continue
            try:
                return _coerce(value, arm, where)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0])
    if origin is list:
        if not isinstance(value, list):
            value = [value]
        (item,) = typing.get_args(annotation)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        _, item = typing.get_args(annotation)
        return {str(k): _coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "5e-3" (no dot) as a string; accept it as the number it means.
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where} must be a string, got {value!r}")
    raise AssertionError(f"unsupported annotation {annotation} at {where}")


def _optional_section(annotation: Any) -> type | None:
    """The dataclass X of a `X | None` field, else None."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    arms = typing.get_args(annotation)
    present = [arm for arm in arms if arm is not type(None)]
    if len(arms) == 2 and len(present) == 1 and isinstance(present[0], type) and dataclasses.is_dataclass(present[0]):
        return present[0]
    return None


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'the config'} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]}; known keys{' of ' + where if where else ''}: {', '.join(sorted(known))}"
        )
    kwargs = {}
    for name, value in values.items():
        path = f"{where}.{name}" if where else name
        annotation = hints[name]
        optional = _optional_section(annotation)
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            kwargs[name] = _build(annotation, value or {}, path)
        elif optional is not None:  # a section that is off when null (e.g. model.lora); {} is its defaults
            kwargs[name] = None if value is None else _build(optional, value, path)
        else:
            kwargs[name] = _coerce(value, annotation, path)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as error:  # a dataclass from outside the config modules (the engine's) names its own field
        raise ConfigError(str(error)) from error


def _apply_override(tree: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value (e.g. train.max_steps=100), got {assignment!r}")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part} is not a section")
    # YAML parsing gives numbers, booleans, null and lists their types.
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(
            f"--set {key}: the value {raw!r} is not valid YAML ({_yaml_problem(error)}); "
            "write it as YAML, e.g. [a.txt, b.txt] or a quoted string"
        ) from error


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's reason in one line, without its own (multi-line) rendering of the place."""
    if isinstance(error, yaml.MarkedYAMLError):
        return " ".join(part for part in (error.context, error.problem) if part)
    return str(error).splitlines()[0]


def _read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file's top-level mapping; a file that is not one is a ConfigError naming the file (and line)."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; recipes live in jobs/configs/")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte offset {error.start}); save it as UTF-8"
        ) from error
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        where = f"{path}, line {mark.line + 1} column {mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"config file {where} is not valid YAML: {_yaml_problem(error)}") from error
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"config file {path} holds a {type(tree).__name__}, not a mapping of sections (model:, data:, ...)"
        )
    return tree


def load_tree(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A YAML recipe (or nothing) as a nested mapping, with `a.b=c` overrides applied."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = _read_yaml(Path(path))
    for assignment in overrides:
        _apply_override(tree, assignment)
    return tree


def build(cls: type, tree: dict[str, Any]) -> Any:
    """Validate a nested mapping into the dataclass tree rooted at `cls` (any config of this project)."""
    return _build(cls, tree, "")
