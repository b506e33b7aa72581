"""Each dataclass's Flyte literal type, built once per process, and the JSON schema default of each field type compiled
once.

flytekit 1.16 rebuilds a dataclass's literal type, JSON schema included, every time it is asked: once per task
interface that names the dataclass and again when a `@dynamic` node compiles its sub-nodes. The run config's sections
appear in most tasks, so importing the workflow spent most of its time building the same schemas again. A
dataclass's literal type depends on the type alone: it is built once and handed out as a copy (callers may annotate
what they get).

Building one schema, mashumaro 3.23 writes each field's default as its serialized form by defining and compiling a
new one-field dataclass per field (`mashumaro.jsonschema.schema._default`): 454 compilations, 0.68 of the 0.79 s the
run config's literal type took. The one-field class depends only on the field's type and the owner's config; it is
compiled once per pair and given each default as its value, which serializes the same: the class's own default
only matters to `omit_default`, under which the original raises instead.
"""

import copy
import functools
from dataclasses import dataclass

from flytekit.core.type_engine import DataclassTransformer
from mashumaro.jsonschema import schema as mashumaro_schema
from mashumaro.mixins.json import DataClassJSONMixin

_built = functools.cache(DataclassTransformer.get_literal_type)


def _literal_type(self: DataclassTransformer, t):
    return copy.deepcopy(_built(self, t))


@functools.cache
def _holder(f_type, config_cls: type) -> type:
    """A dataclass of one field `x` of f_type, serialized under config_cls."""

    @dataclass
    class Holder(DataClassJSONMixin):
        x: f_type

        class Config(config_cls):
            pass

    return Holder


_compiling = mashumaro_schema._default


def _default(f_type, f_value, config_cls):
    try:
        holder = _holder(f_type, config_cls)
    except TypeError:  # an unhashable type annotation: compiled for this field alone, as mashumaro does
        return _compiling(f_type, f_value, config_cls)
    return holder(f_value).to_dict()["x"]


DataclassTransformer.get_literal_type = _literal_type
mashumaro_schema._default = _default
