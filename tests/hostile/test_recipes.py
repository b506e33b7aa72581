"""Malformed recipes, generated here from the config dataclasses and by hand: each is refused with a
short ConfigError naming the file and the key path or value (the command line: exit 2 and one
`bad recipe:` line), never a traceback, never a message that grows with the input."""

import dataclasses
import typing
from pathlib import Path

import pytest

from miles_core.config.base import ConfigError
from miles_core.config.bounded_yaml import MAX_DEPTH, MAX_RECIPE_BYTES
from miles_core.config.recipe import load_recipe, main
from miles_core.config.run import RunConfig

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
MAX_LINES, MAX_CHARS = 5, 500


def leaves(cls, prefix=""):
    """(dotted key, type) of every scalar field of a config dataclass, nested sections included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from leaves(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", kind


def sections(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield f"{prefix}{f.name}"
            yield from sections(hints[f.name], f"{prefix}{f.name}.")


def nest(dotted: str, value: str) -> str:
    """`a.b.c: v` as flow YAML `a: {b: {c: v}}`."""
    *parents, last = dotted.split(".")
    text = f"{{{last}: {value}}}"
    for key in reversed(parents[1:]):
        text = f"{{{key}: {text}}}"
    return f"{parents[0]}: {text}\n" if parents else f"{last}: {value}\n"


WRONG = {int: ("1.5", "float"), float: ("fast", "str"), str: ("[1, 2]", "list"), bool: ("3", "int")}
TYPE_CASES = [(f"type-{key}", nest(key, WRONG[kind][0]), f"{key}: expected {kind.__name__}, got {WRONG[kind][1]}") for key, kind in leaves(RunConfig)]
FINITE_CASES = [
    (f"{word}-{key}", nest(key, value), f"{key}: must be a finite number")
    for key, kind in leaves(RunConfig)
    if kind is float
    for word, value in (("nan", ".nan"), ("inf", "-.inf"))
]
UNKNOWN_CASES = [("unknown-top", "name: x\nno_such_key: 1\n", "no_such_key: unknown key")] + [
    (f"unknown-{section}", nest(f"{section}.no_such_key", "1"), f"{section}.no_such_key: unknown key") for section in sections(RunConfig)
]
SECTION_NOT_MAPPING = [(f"scalar-{section}", nest(section, "7"), f"{section}: expected a mapping, got int") for section in sections(RunConfig)]


def bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


SHAPE_CASES = [
    ("alias-bomb", bomb(30), "anchors (&a0) are not allowed"),
    ("alias-single", "name: &n x\niterations: 1\nrun_root: *n\n", "anchors (&n) are not allowed"),
    ("merge-key", "base: &b {seed: 1}\ntrain: {<<: *b}\n", "anchors (&b) are not allowed"),
    ("alias-undefined", "name: *nowhere\n", "aliases (*nowhere) are not allowed"),
    ("deep-block", "".join("  " * i + f"k{i}:\n" for i in range(MAX_DEPTH + 4)) + "  " * (MAX_DEPTH + 4) + "v\n", f"nested deeper than {MAX_DEPTH}"),
    ("deep-flow", "name: " + "[" * 5000 + "]" * 5000 + "\n", f"nested deeper than {MAX_DEPTH}"),
    ("deep-mapping-flow", "name: " + "{a: " * 200 + "1" + "}" * 200 + "\n", f"nested deeper than {MAX_DEPTH}"),
    ("duplicate-top", "name: a\nname: b\n", "duplicate key 'name'"),
    ("duplicate-section", "name: a\ntrain: {lr: 0.1}\ntrain: {lr: 0.2}\n", "duplicate key 'train'"),
    ("duplicate-nested", "name: a\ntrain: {lr: 0.1, lr: 0.2}\n", "duplicate key 'lr'"),
    ("key-int", "name: a\n1: 2\n", "key 1 is not a string"),
    ("key-null", "name: a\n~: 2\n", "key None is not a string"),
    ("key-bool", "name: a\ntrue: 2\n", "key True is not a string"),
    ("key-float-nested", "name: a\ntrain: {0.5: 1}\n", "key 0.5 is not a string"),
    ("key-list", "name: a\n? [1, 2]\n: 3\n", "line 2: key [1, 2] is not a string"),
    ("tab-indent", "name: a\ntrain:\n\tlr: 0.1\n", "not valid YAML at line 3"),
    ("unclosed-flow", "name: a\ntrain: {lr: 0.1\n", "not valid YAML"),
    ("unclosed-quote", 'name: "abc\n', "not valid YAML"),
    ("bad-indent", "name: a\n  train: 1\n iterations: 2\n", "not valid YAML"),
    ("two-documents", "name: a\n---\nname: b\n", "not valid YAML"),
    ("python-tag", "name: !!python/object/apply:os.system [echo hi]\n", "not valid YAML"),
    ("unknown-tag", "name: !secret x\n", "not valid YAML"),
    ("binary-tag", "name: !!binary aGVsbG8=\n", "name: expected str, got bytes"),
    ("set-tag", "name: !!set {a, b}\n", "name: expected str, got set"),
    ("top-list", "- name: a\n", "recipe: expected a mapping, got list"),
    ("top-scalar", "just words\n", "recipe: expected a mapping, got str"),
    ("top-int", "42\n", "recipe: expected a mapping, got int"),
    ("empty", "", "is empty"),
    ("comments-only", "# nothing here\n", "is empty"),
    ("empty-mapping", "{}\n", "is empty"),
    ("null-value", "name: a\niterations: ~\n", "iterations: expected int, got NoneType"),
    ("date-value", "name: 2024-01-01\n", "name: expected str, got date"),
    ("huge-string-wrong-type", "iterations: '" + "9" * 400_000 + "'\n", "iterations: expected int, got str '999"),
    ("huge-unknown-key", "name: a\n? " + "k" * 100_000 + "\n: 1\n", "kkk...: unknown key"),
    ("huge-plain-key", "name: a\n" + "k" * 100_000 + ": 1\n", "could not find expected ':'"),
    ("huge-list-wrong-type", "name: [" + ", ".join(["1"] * 50_000) + "]\n", "name: expected str, got list [1, 1"),
    ("extends-self", "extends: {self}\nname: a\n", "extended in a cycle"),
    ("extends-missing", "extends: no_such.yaml\nname: a\n", "no_such.yaml not found"),
    ("extends-absolute", "extends: /etc/passwd\nname: a\n", "extends: expected a recipe path relative to"),
    ("extends-number", "extends: 3\nname: a\n", "extends: expected a recipe path relative to"),
    ("extends-list", "extends: [a.yaml]\nname: a\n", "extends: expected a recipe path relative to"),
    ("extends-empty", "extends: ''\nname: a\n", "extends: expected a recipe path relative to"),
    ("extends-directory", "extends: .\nname: a\n", "cannot read the recipe"),
]
BYTE_CASES = [
    ("latin1", "name: café\n".encode("latin-1"), "not UTF-8 (byte 9"),
    ("utf16", "name: a\n".encode("utf-16"), "not UTF-8 (byte 0"),
    ("binary-junk", bytes(range(128, 256)) * 8, "not UTF-8 (byte 0"),
    ("nul-byte", b"name: a\x00b\n", "NUL byte at character 7"),
    ("encoded-surrogate", b"name: \xed\xa0\x80\n", "not UTF-8 (byte 6"),
    ("truncated-sequence", b"name: caf\xc3\n", "not UTF-8 (byte 9"),
    ("control-char", b"name: a\x07b\n", "not valid YAML"),
    ("oversize", b"name: '" + b"x" * MAX_RECIPE_BYTES + b"'\n", f"more than the {MAX_RECIPE_BYTES} a recipe may have"),
]


def assert_short(message: str) -> None:
    assert len(message) <= MAX_CHARS and message.count("\n") < MAX_LINES, message[:600]
    assert "Traceback" not in message


def load(tmp_path, name, blob):
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(blob.replace(b"{self}", path.name.encode()))
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    return path, str(err.value)


ALL_TEXT = TYPE_CASES + FINITE_CASES + UNKNOWN_CASES + SECTION_NOT_MAPPING + SHAPE_CASES


@pytest.mark.parametrize(("name", "text", "expected"), ALL_TEXT, ids=[case[0] for case in ALL_TEXT])
def test_a_malformed_recipe_is_refused_naming_the_file_and_key(tmp_path, name, text, expected):
    path, message = load(tmp_path, name, text.encode())
    assert message.startswith(f"{path}: "), message[:200]
    assert expected in message, message[:300]
    assert_short(message)


@pytest.mark.parametrize(("name", "blob", "expected"), BYTE_CASES, ids=[case[0] for case in BYTE_CASES])
def test_a_recipe_of_bad_bytes_is_refused_naming_the_file(tmp_path, name, blob, expected):
    path, message = load(tmp_path, name, blob)
    assert message.startswith(f"{path}: {path.name}: "), message[:200]
    assert expected in message, message[:300]
    assert_short(message)


def test_a_malformed_extended_recipe_is_named_by_its_own_file(tmp_path):
    (tmp_path / "base.yaml").write_text("name: a\nname: b\n")
    path, message = load(tmp_path, "top", b"extends: base.yaml\niterations: 2\n")
    assert message == f"{path}: base.yaml: line 2: duplicate key 'name'"


def test_an_extends_cycle_through_two_files_is_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\nname: b\n")
    with pytest.raises(ConfigError, match="a.yaml is extended in a cycle"):
        load_recipe(tmp_path / "a.yaml")


GOOD = "name: ok\n"
CLI_CASES = [
    ("no-equals", ["train.lr"], "override 'train.lr': expected key=value"),
    ("empty-key", ["=3"], "override '=3': expected key=value"),
    ("unknown-key", ["train.no_such=1"], "train.no_such: unknown key"),
    ("unknown-section", ["nowhere.lr=1"], "nowhere: unknown key"),
    ("wrong-type", ["train.lr=fast"], "train.lr: expected float, got str 'fast'"),
    ("nan", ["train.lr=.nan"], "train.lr: must be a finite number"),
    ("bad-yaml-value", ["name=[unclosed"], "override 'name': value '[unclosed' is not a YAML value"),
    ("through-a-scalar", ["name.sub=1"], "override 'name.sub': name is not a section"),
    ("empty-part", ["train..lr=1"], "override 'train..lr': empty key in the dotted path"),
    ("trailing-dot", ["train.=1"], "override 'train.': empty key in the dotted path"),
    ("seed-text", ["seed=abc"], "seed: expected int, got str 'abc'"),
    ("huge-value", ["name=[" + ",".join(["1"] * 20_000) + "]"], "name: expected str, got list [1, 1"),
    (
        "alias-bomb",
        ["name=[" + ", ".join(f"&a{i} [*a{i - 1}, *a{i - 1}]" if i else "&a0 [x, x]" for i in range(40)) + "]"],
        "override 'name': line 1: YAML anchors (&a0)",
    ),
    ("duplicate-in-value", ["train={lr: 0.1, lr: 0.2}"], "override 'train': line 1: duplicate key 'lr'"),
    ("section-scalar", ["train=3"], "train: expected a mapping, got int"),
    ("missing-recipe", None, "recipe file not found"),
]


@pytest.mark.parametrize(("name", "args", "expected"), CLI_CASES, ids=[case[0] for case in CLI_CASES])
def test_a_bad_command_line_exits_2_with_one_short_line(tmp_path, capsys, name, args, expected):
    recipe = tmp_path / "good.yaml"
    recipe.write_text(GOOD)
    argv = [str(recipe), *args] if args is not None else [str(tmp_path / "absent.yaml")]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("bad recipe: ") and expected in out.err, out.err[:300]
    assert_short(out.err)


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_still_loads(recipe):
    assert load_recipe(recipe).name


def test_the_corpus_is_large_enough():
    assert len(ALL_TEXT) + len(BYTE_CASES) + len(CLI_CASES) >= 100
