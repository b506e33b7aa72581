"""Each dataclass's Flyte literal type, built once per process.

flytekit 1.16 rebuilds a dataclass's literal type, JSON schema included (mashumaro generates a class per nested
dataclass to build it), every time it is asked: once per task interface that names the dataclass and again when a
`@dynamic` node compiles its sub-nodes. The run config's sections appear in most tasks, so importing the workflow spent
most of its time building the same schemas again. A dataclass's literal type depends on the type alone: it is built
once and handed out as a copy (callers may annotate what they get).
"""

import copy
import functools

from flytekit.core.type_engine import DataclassTransformer

_built = functools.cache(DataclassTransformer.get_literal_type)


def _literal_type(self: DataclassTransformer, t):
    return copy.deepcopy(_built(self, t))


DataclassTransformer.get_literal_type = _literal_type
