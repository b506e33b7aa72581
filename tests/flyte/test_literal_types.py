"""The run config's literal types as tasks/literal_types.py builds them are the ones flytekit and mashumaro build."""

import dataclasses
import typing

import mashumaro.jsonschema.schema as mashumaro_schema
import pytest
from flytekit.core.type_engine import DataclassTransformer
from mashumaro.jsonschema import build_json_schema

import tasks.literal_types as literal_types
from miles_core.config import RunConfig

SECTIONS = [RunConfig] + sorted({type(getattr(RunConfig(), f.name)) for f in dataclasses.fields(RunConfig)} - {int, str, float, bool}, key=str)


@pytest.mark.parametrize("config", SECTIONS, ids=lambda t: t.__name__)
def test_schema_defaults_are_mashumaros_own(config, monkeypatch):
    """Every field default in the JSON schema, and the whole schema, as mashumaro's per-field compilation writes it."""
    ours = build_json_schema(config).to_dict()
    monkeypatch.setattr(mashumaro_schema, "_default", literal_types._compiling)
    assert ours == build_json_schema(config).to_dict()


def test_literal_type_is_flytekits_and_a_copy(monkeypatch):
    """The cached literal type equals flytekit's own, built afresh, and each caller gets its own copy."""
    transformer = DataclassTransformer()
    first, second = transformer.get_literal_type(RunConfig), transformer.get_literal_type(RunConfig)
    assert first == second and first is not second
    monkeypatch.setattr(mashumaro_schema, "_default", literal_types._compiling)
    assert first == literal_types._built.__wrapped__(transformer, RunConfig)


def test_an_unhashable_type_compiles_on_its_own():
    """A field type that cannot be a cache key (a list inside Annotated) still gets its default written."""
    assert literal_types._default(typing.Annotated[int, [1]], 3, mashumaro_schema.BaseConfig) == 3
