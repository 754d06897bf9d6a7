"""What README.md and docs/*.md tell a user to type resolves against the code, so that a copy-pasted line works.

docs/BENCHMARKS.md is a dated log of what was run then, and is not checked. From every fenced code block line and
every inline code span of the other documents this takes

* each config override ``section.key=value`` (and ``recipe=NAME``): the key must be one of the run schema's
  (``rlrepro.cli._unknown_key_hint``, the check ``rlrepro train`` runs), the recipe one that ships, and the values
  of one line or span, applied together on the recipe they name (else ``grpo_tiny``, or ``grpo_tiny_tool`` for
  ``env.*``), must pass the schema's types and ``rlrepro.orchestration.config.validate``; ``a|b|c`` is each choice;
* each whole ``rlrepro train recipe=NAME ...`` command line: composed by ``rlrepro.cli.compose_config`` as typed;
* each ``rlrepro COMMAND --flag``: the command must exist and its ``--help`` must list the flag.

CPU only, no network, no run: composing configs and printing help texts.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlrepro import cli
from rlrepro.orchestration.config import ConfigError, RunSchema, migrate_override, validate

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "BENCHMARKS.md")
# the run schema's sections, plus the legacy ``trainer.`` spelling that rlrepro train still reads (with a warning)
SECTIONS = tuple(f.name for f in dataclasses.fields(RunSchema) if f.name != "recipe") + ("trainer",)
OVERRIDE = re.compile(r"[+~]{0,2}(?:%s)(?:\.\w+)+=.*" % "|".join(SECTIONS), re.S)
RECIPE = re.compile(r"(?<![\w.-])recipe=([\w.]+)")
COMMAND = re.compile(r"\brlrepro (train|diff|verify|show|plot|generate|export|eval|recipes)\b(.*)")
# a value that names what to type rather than being it: N, K>0, VALUE, ..., <one of those>, HEAD_IP:6379
PLACEHOLDER = re.compile(r"^(\.\.\.|<.*|[A-Z][A-Z_]*(>0)?|[A-Z_]+:\w+)$")

# Overrides shown on purpose in a form that does not resolve on its own; each entry says why. Keep it short.
ALLOWED = {
    # DATA.md's list of the data layer's error messages quotes `fix` forms with placeholders in them
    "data.prompt_field=<one",
    # DATA.md names DAPO's symbols: L_cache (the buffer length) and f (the penalty factor)
    "reward.overlong_buffer=L_cache", "reward.overlong_penalty_factor=f",
    # ENVS.md: `register_env("name")` makes `env.name=name` work, where "name" is the registered one
    "env.name=name",
    # TRAINER.md: CISPO's clip_low=1.0 in a sentence about train.policy_loss=cispo (refused with ppo_clip)
    "train.clip_low=1.0",
}


@dataclasses.dataclass
class Span:
    where: str  # FILE:LINE
    text: str
    block: bool  # a line of a fenced code block (else inline code)


def spans(path: Path) -> list[Span]:
    out, fence, pending = [], False, None
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        where = f"{path.relative_to(ROOT)}:{n}"
        if fence:  # shell continuation lines make one command
            text = line.rstrip()
            if pending is not None:
                pending.text += " " + text.rstrip("\\")
            else:
                pending = Span(where, text.rstrip("\\"), True)
            if not text.endswith("\\"):
                out.append(pending)
                pending = None
            continue
        out += [Span(where, m.group(1), False) for m in re.finditer(r"`([^`]+)`", line)]
    return out


def all_spans() -> list[Span]:
    return [s for p in DOCS for s in spans(p)]


def _words(text: str) -> list[str]:
    """A command line as the shell splits it (comments dropped), or on white space where it is not shell."""
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return text.split()


def commands(span: Span) -> list[tuple[str, list[str]]]:
    """``rlrepro COMMAND ARGS`` in the span: (command, its words up to ``&&``, ``;`` or ``|``)."""
    m = COMMAND.search(span.text)
    if not m:
        return []
    args = []
    for word in _words(m.group(2)):
        if word in ("&&", "||", ";", "|", ">"):
            break
        args.append(word)
    return [(m.group(1), args)]


def overrides(span: Span) -> list[str]:
    """The span's ``key=value`` words; ``a|b`` (a markdown table writes ``a\\|b``) stays one word."""
    cmd = commands(span)
    if cmd and cmd[0][0] == "train":
        return [w for w in cmd[0][1] if "=" in w and not w.startswith("-") and not w.startswith("recipe=")
                and OVERRIDE.match(w)]
    out = []
    for word in _words(span.text.replace("\\|", "|")):
        if not word.endswith("..."):
            word = re.sub(r"[,;.]$", "", word)  # prose punctuation after the span's last word
        if word.endswith(")") and "(" not in word:
            word = word[:-1]
        if OVERRIDE.fullmatch(word):
            out.append(word)
    return out


def recipes_named(span: Span) -> list[str]:
    return [r for r in RECIPE.findall(span.text) if r not in ("...", "NAME")]


# ----------------------------------------------------------------------------------------------- config keys
@lru_cache(maxsize=None)
def schema():
    return OmegaConf.structured(RunSchema)


def key_of(override: str) -> str:
    return migrate_override(override, warn=False).lstrip("+~").split("=", 1)[0]


def test_every_documented_key_is_a_config_key():
    bad = []
    for span in all_spans():
        for item in overrides(span):
            hint = cli._unknown_key_hint(key_of(item), schema())
            if hint:
                bad.append(f"{span.where}: {item}: {hint}")
    assert not bad, "documented keys that rlrepro train refuses:\n" + "\n".join(bad)


def test_every_documented_recipe_ships():
    shipped = cli.list_recipes()
    bad = [f"{s.where}: recipe={r}" for s in all_spans() for r in recipes_named(s) if r not in shipped]
    assert not bad, f"recipes that do not ship (shipped: {shipped}):\n" + "\n".join(bad)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """Values for the keys a recipe leaves to the user (``???``: model.path, data.source): a model directory and a
    data file (the checks before any work look at neither's contents)."""
    root = tmp_path_factory.mktemp("docs_keys")
    (root / "model").mkdir()
    (root / "data.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    return {"model.path": str(root / "model"), "data.source": str(root / "data.jsonl")}


def _fill(recipe: str, given: list[str], stand_ins: dict) -> list[str]:
    node = OmegaConf.load(cli.RECIPES_DIR / f"{recipe}.yaml")
    set_keys = {key_of(o) for o in given}
    return [f"{k}={stand_ins[k]}" for k in OmegaConf.missing_keys(node) if k not in set_keys]


@lru_cache(maxsize=None)
def _base(recipe: str, fill: tuple[str, ...]):
    return cli.compose_config([f"recipe={recipe}", *fill])


def _alternatives(items: list[str]) -> list[list[str]]:
    """``train.is_correction=tis|mis`` -> one list per choice (the other items kept)."""
    out = [[]]
    for item in items:
        key, value = item.split("=", 1)
        choices = value.split("|") if "|" in value and not value.startswith(("'", '"')) else [value]
        out = [prev + [f"{key}={c}"] for prev in out for c in choices]
    return out


def _apply(cfg, items: list[str]) -> None:
    """The overrides on a composed config, each value parsed by hydra's override grammar (as rlrepro train does)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for item in items:
        item = cli._into_mapping(migrate_override(item, warn=False), schema())
        o = parser.parse_override(item)
        OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True, force_add=item.startswith("++"))


def _resolves(recipe: str, items: tuple[str, ...], stand_ins: dict, memo: dict) -> str | None:
    """None when the overrides, applied together on the recipe, pass the schema and validate(); else why not."""
    if (recipe, items) in memo:
        return memo[recipe, items]
    memo[recipe, items] = None
    cfg = copy.deepcopy(_base(recipe, tuple(_fill(recipe, list(items), stand_ins))))
    try:
        _apply(cfg, list(items))
        validate(cfg)
    except Exception as e:  # noqa: BLE001 - every refusal is reported with the span
        memo[recipe, items] = str(e).strip().splitlines()[0]
    return memo[recipe, items]


def test_documented_values_resolve(stand_ins):
    """The overrides of one span hold in the recipe the span names, or else in at least one shipped recipe: a span
    in prose (``train.grad_sync=megatron``) is one setting of a run whose other keys it does not repeat."""
    bad, memo = [], {}
    for span in all_spans():
        items = [o for o in overrides(span) if o not in ALLOWED and not PLACEHOLDER.match(o.split("=", 1)[1])]
        if not items:
            continue
        candidates = recipes_named(span) or sorted(cli.list_recipes(), key=lambda r: r != "grpo_tiny")
        for variant in _alternatives(items):
            first = None
            for recipe in candidates:
                why = _resolves(recipe, tuple(variant), stand_ins, memo)
                if why is None:
                    break
                first = first or f"recipe={recipe}: {why}"
            else:
                bad.append(f"{span.where}: {' '.join(variant)} ({first})")
    assert not bad, "documented overrides that do not resolve:\n" + "\n".join(bad)


def test_documented_train_command_lines_compose(stand_ins):
    """A whole ``rlrepro train recipe=NAME ...`` line (no ``...`` in it) composes as typed."""
    bad, seen = [], 0
    for span in all_spans():
        for cmd, args in commands(span):
            recipe = next((a.split("=", 1)[1] for a in args if a.startswith("recipe=")), "...")
            if cmd != "train" or "..." in args or recipe in ("...", "NAME"):
                continue
            typed = [a for a in args if a not in ("--cfg", "\\")]
            fill = _fill(recipe, typed, stand_ins) if recipe in cli.list_recipes() else []
            seen += 1
            try:
                cli.compose_config(typed + fill)
            except ConfigError as e:
                bad.append(f"{span.where}: rlrepro train {' '.join(typed)}: {e}")
    assert seen >= 5, "the README's command lines were not found"
    assert not bad, "documented command lines that rlrepro train refuses:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------------------------- CLI flags
@lru_cache(maxsize=None)
def help_text(command: str) -> str:
    """``rlrepro COMMAND --help`` as the CLI prints it; a command that does not exist fails here."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            rc = cli.main([command, "--help"])
        except SystemExit as e:  # argparse's --help
            rc = e.code
    assert rc == 0, f"rlrepro {command} --help exits {rc}"
    return out.getvalue()


def documented_flags() -> list[tuple[str, str, str]]:
    found = []
    for span in all_spans():
        for cmd, args in commands(span):
            for word in args:
                word = word.strip("[]")
                if word.startswith("--"):
                    found.append((span.where, cmd, word.split("=", 1)[0]))
    return found


def test_every_documented_flag_exists():
    flags = documented_flags()
    assert len(flags) >= 10, "the README's command lines were not found"
    bad = [f"{where}: rlrepro {cmd} {flag}" for where, cmd, flag in flags
           if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text(cmd))]
    assert not bad, "documented flags that the command does not have:\n" + "\n".join(bad)
