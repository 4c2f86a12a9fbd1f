"""gpt2_platform.config_loader on a config tree of its own: what every config of the project (training,
batch, evaluation, the engine's settings inside them) reports the same way."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from gpt2_platform.config_loader import ConfigError, build, load_tree


@dataclass
class Inner:
    count: int = 1
    rate: float = 0.5
    flag: bool = False
    name: str = "x"
    mode: Literal["a", "b"] = "a"
    limit: int | None = None
    paths: list[str] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"inner.count must be >= 1, got {self.count}")


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    title: str = "t"
    extra: Inner | None = None


def load(path: Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Outer:
    return build(Outer, load_tree(path, overrides))


def test_a_file_and_overrides_on_top_of_it(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  count: 3\n  name: file\ntitle: from-file\n")
    config = load(path, ["inner.count=7", "title=set"])
    assert (config.inner.count, config.inner.name, config.title) == (7, "file", "set")
    assert load() == Outer()


def test_override_values_take_their_types_from_yaml() -> None:
    config = load(None, ["inner.paths=one.txt", "inner.limit=null", "inner.weights={a: 0.5}", "inner.flag=true"])
    assert config.inner.paths == ["one.txt"]  # a single value for a list field becomes a list of one
    assert config.inner.limit is None
    assert config.inner.weights == {"a": 0.5}
    assert config.inner.flag is True
    assert load(None, ["inner.name=12"]).inner.name == "12"  # a string field takes what YAML read as a number


def test_a_float_in_exponent_notation_is_a_number(tmp_path: Path) -> None:
    # PyYAML (YAML 1.1) reads `1e-4`, without a dot, as the string '1e-4'.
    assert load(None, ["inner.rate=1e-4"]).inner.rate == 1e-4
    path = tmp_path / "rate.yaml"
    path.write_text("inner:\n  rate: 6e-4\n")
    assert load(path).inner.rate == 6e-4


def test_an_override_without_an_equals_sign_is_refused() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        load(None, ["inner.count"])


def test_an_override_into_a_value_that_is_not_a_section_is_refused() -> None:
    with pytest.raises(ConfigError, match="^--set title.x: title is not a section"):
        load(None, ["title=t", "title.x=1"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("bogus=1", "unknown config key bogus; known keys: extra, inner, title"),
        ("inner.bogus=1", "unknown config key inner.bogus; known keys of inner: count, flag,"),
    ],
)
def test_unknown_keys_are_named_with_the_known_ones(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        load(None, [override])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("inner.count=abc", "inner.count must be an integer, got 'abc'"),
        ("inner.count=5.5", "inner.count must be an integer, got 5.5"),
        ("inner.count=true", "inner.count must be an integer, got True"),
        ("inner.flag=maybe", "inner.flag must be true or false, got 'maybe'"),
        ("inner.rate=fast", "inner.rate must be a number, got 'fast'"),
        ("inner.weights=[1]", "inner.weights must be a mapping, got [1]"),
        ("inner.mode=c", "inner.mode must be one of 'a', 'b', got 'c'"),
        ("inner.limit=many", "inner.limit must be an integer, got 'many'"),
        ("inner=3", "inner must be a mapping, got 3"),
    ],
)
def test_a_wrong_type_names_the_field_and_what_it_must_be(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        load(None, [override])


def test_a_dataclass_own_check_becomes_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^inner.count must be >= 1, got 0$"):
        load(None, ["inner.count=0"])


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("inner:\n  count: 1\n title: x\n", "line 3 column 2 is not valid YAML"),
        ("inner:\n  paths: [1, 2\n", "line 3 column 1 is not valid YAML: while parsing a flow sequence"),
        ("inner:\n\tcount: 3\n", "line 2 column 1 is not valid YAML: .*'\\\\t'"),
        ("inner: count: 3\n", "line 1 column 13 is not valid YAML: mapping values are not allowed"),
        ("- inner\n- title\n", "holds a list, not a mapping of sections"),
    ],
    ids=["bad-indent", "unclosed-list", "tab", "colon-in-value", "top-level-list"],
)
def test_malformed_yaml_names_the_file_and_line_in_one_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^config file {re.escape(str(path))}.*{expected}") as error:
        load(path)
    assert "\n" not in str(error.value), "one line, without PyYAML's multi-line rendering"


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^config file {re.escape(str(tmp_path / 'none.yaml'))} does not exist"):
        load(tmp_path / "none.yaml")


def test_a_file_that_is_not_utf8_names_the_offset(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("title: caf\xe9\n".encode("latin-1"))
    with pytest.raises(
        ConfigError, match=f"^config file {re.escape(str(path))} is not UTF-8 text \\(byte offset 10\\)"
    ):
        load(path)


def test_malformed_yaml_in_a_set_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^--set inner.paths: the value '\[a.txt,' is not valid YAML"):
        load(None, ["inner.paths=[a.txt,"])


def test_an_empty_file_is_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load(path) == Outer()


def test_the_batch_config_reports_malformed_yaml_as_training_does(tmp_path: Path) -> None:
    from gpt2_platform.batch import config as batch_config
    from gpt2_platform.train import config as train_config

    path = tmp_path / "batch.yaml"
    path.write_text("input:\n  paths: [prompts.parquet\noutput:\n  path: out\n")
    expected = f"^config file {re.escape(str(path))}, line 3 column 7 is not valid YAML"
    for loader in (batch_config.load, train_config.load):
        with pytest.raises(ConfigError, match=expected):
            loader(path)


def test_set_takes_several_values_and_repeats() -> None:
    import argparse

    from gpt2_platform.jobs_common import add_config_arguments

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, "train.max_steps=100")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(["--set", "a.b=1", "c.d=2", "--set", "e.f=3", "--profile"])
    assert args.overrides == ["a.b=1", "c.d=2", "e.f=3"] and args.profile
    assert parser.parse_args([]).overrides == []
    assert load_tree(None, args.overrides) == {"a": {"b": 1}, "c": {"d": 2}, "e": {"f": 3}}


def test_an_optional_section_is_off_when_null_and_its_defaults_when_empty(tmp_path: Path) -> None:
    assert load().extra is None
    assert load(overrides=["extra=null"]).extra is None
    assert load(overrides=["extra={}"]).extra == Inner()
    assert load(overrides=["extra.count=3"]).extra == Inner(count=3)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("extra:\n  mode: b\n")
    assert load(recipe).extra == Inner(mode="b")
    with pytest.raises(ConfigError, match=r"unknown config key extra\.nope"):
        load(overrides=["extra.nope=1"])
    with pytest.raises(ConfigError, match="inner.count must be >= 1"):
        load(overrides=["extra.count=0"])
