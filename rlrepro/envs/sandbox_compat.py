"""What keeps a sandbox result the same across Python versions and process settings (:mod:`rlrepro.envs.sandbox`).

The interpreter runs on whatever CPython the worker has (3.11 on one machine, 3.12 or 3.13 on another), so four
things that CPython decides by version are fixed here instead:

* **syntax errors** are one fixed text, ``SyntaxError: invalid syntax (line N)``: CPython's parser words them
  differently in every version (``non-default argument follows default argument`` became ``parameter without a
  default follows parameter with a default``). Syntax that only 3.12+ accepts (PEP 701 f-strings such as
  ``f"{'\\n'.join(xs)}"`` or ``f"{d["k"]}"``, type parameters, ``type X = ...``, identifiers or ``\\N{...}`` names
  of characters new since Unicode 14.0) is that same error there too, as 3.11 rejects it. The process's warnings
  filters (``-W error``) do not turn a parser warning (``'\\d'``) into an error.
* **Unicode**: each version has its own Unicode database (14.0, 15.0, 15.1). A string holding one of the ~5,100
  code points whose properties differ between them keeps them as values (comparing, slicing, printing, joining),
  but ``repr`` escapes those that are new (as 3.11 shows them) and the case methods, the ``is...`` tests and
  ``int()``/``float()`` of such a string are refused with a fixed message.
* **CPython's runtime messages** that differ between versions are rewritten to one text (:func:`exception_text`).
* ints in messages are never converted in full (``sys.set_int_max_str_digits`` would decide the text).

The tables were computed by comparing every code point's behaviour under CPython 3.11.7, 3.12.1 and 3.13.0.
"""
from __future__ import annotations

import ast
import io
import re
import sys
import threading
import tokenize
import warnings
from typing import Any, Optional

__all__ = ["parse_source", "syntax_error", "repr_str", "unicode_problem", "exception_text", "INVALID_SYNTAX"]

INVALID_SYNTAX = "SyntaxError: invalid syntax"


def _ranges(spec: str) -> re.Pattern:
    parts = []
    for item in spec.split():
        lo, _, hi = item.partition("-")
        parts.append(f"\\U{int(lo, 16):08x}" + (f"-\\U{int(hi, 16):08x}" if hi else ""))
    return re.compile("[" + "".join(parts) + "]")


# code points assigned after Unicode 14.0 (shown escaped by 3.11's repr, literally by 3.12+)
_NEW = ("CF3 ECE 2FFC-2FFF 31EF 10EFD-10EFF 1123F-11241 11B00-11B09 11F00-11F10 11F12-11F3A 11F3E-11F59 1342F "
        "13440-13455 1B132 1B155 1D2C0-1D2D3 1DF25-1DF2A 1E030-1E06D 1E08F 1E4D0-1E4F9 1F6DC 1F774-1F776 "
        "1F77B-1F77F 1F7D9 1FA75-1FA77 1FA87-1FA88 1FAAD-1FAAF 1FABB-1FABD 1FABF 1FACE-1FACF 1FADA-1FADB 1FAE8 "
        "1FAF7-1FAF8 2B739 2EBF0-2EE5D 31350-323AF")
_NEW_RE = _ranges(_NEW)
# code points whose upper/lower/title/swapcase/capitalize differ between 3.11, 3.12 and 3.13
_CASE_RE = _ranges(_NEW + " 10FC A7F2-A7F4 AB69")
# code points whose isdigit/isalpha/isnumeric/... (and int()/float() digits) differ
_PRED_RE = _ranges("10FC 4E24 4EAC 4FE9 5006 62D0 6D1E 7695 79ED 920E 94A9 A7F2-A7F4 AB69 1123F-11240 11F02 "
                   "11F04-11F10 11F12-11F33 11F50-11F59 1342F 13441-13446 1B132 1B155 1D2C0-1D2D3 1DF25-1DF2A "
                   "1E030-1E06D 1E4D0-1E4EB 1E4F0-1E4F9 2B739 2EBF0-2EE5D 31350-323AF")
# code points whose use in an identifier differs (3.11 rejects them, or 3.13 accepts them)
_IDENT_RE = _ranges(_NEW + " 200C-200D 30FB FF65")

_CASE_METHODS = frozenset({"upper", "lower", "title", "capitalize", "swapcase"})
_PRED_METHODS = frozenset({"isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper", "isnumeric",
                           "isdecimal", "int", "float"})


def unicode_problem(s: str, what: str) -> Optional[str]:
    """Why ``what`` (a str method's name, or ``int``/``float``) cannot run on ``s``: it holds a code point whose
    Unicode properties that operation reads differ between Python versions; None when it can."""
    pattern = _CASE_RE if what in _CASE_METHODS else _PRED_RE if what in _PRED_METHODS else None
    m = None if pattern is None or s.isascii() else pattern.search(s)
    if m is None:
        return None
    call = f"{what}()" if what in ("int", "float") else f"str.{what}()"
    return (f"{call} on a string holding U+{ord(m.group()):04X}: that character's Unicode properties differ "
            f"between Python versions (Unicode 14.0 to 15.1), so the result would too")


def repr_str(s: str) -> str:
    """``repr(s)`` as Python 3.11 writes it in every version: characters new since Unicode 14.0 escaped."""
    text = repr(s)
    if s.isascii() or _NEW_RE.search(text) is None:
        return text
    return _NEW_RE.sub(lambda m: f"\\U{ord(m.group()):08x}" if ord(m.group()) > 0xFFFF else
                       f"\\u{ord(m.group()):04x}", text)


# ------------------------------------------------------------------------------------------------ parsing

_PARSE_LOCK = threading.Lock()


def syntax_error(line: Optional[int]) -> str:
    return INVALID_SYNTAX + (f" (line {line})" if line else "")


def parse_source(code: str) -> ast.Module:
    """``ast.parse(code)`` as every Python version parses it: a SyntaxError (render it with :func:`syntax_error`
    from its ``lineno``) for what this version's parser or 3.11's rejects."""
    if "\0" in code:  # 3.11 raises ValueError for it, 3.12 SyntaxError
        raise SyntaxError(INVALID_SYNTAX, ("<sandbox>", code[:code.index("\0")].count("\n") + 1, 0, ""))
    with _PARSE_LOCK, warnings.catch_warnings():
        # a parser warning ('\d', 1if x) must not become an error under the process's filters (-W error)
        warnings.simplefilter("ignore")
        tree = ast.parse(code, mode="exec")
    line = _newer_syntax(code, tree)
    if line is not None:
        raise SyntaxError(INVALID_SYNTAX, ("<sandbox>", line, 0, ""))
    return tree


def _newer_syntax(code: str, tree: ast.Module) -> Optional[int]:
    """The line of the first construct that this Python accepts and 3.11 does not, or None."""
    if not code.isascii():
        for node in ast.walk(tree):
            if any(_IDENT_RE.search(n) for n in _names(node)):
                return getattr(node, "lineno", 1)
    if "\\N{" in code:
        import unicodedata
        for m in re.finditer(r"\\N\{([^}\n]*)\}", code):
            try:
                ch = unicodedata.lookup(m.group(1))
            except KeyError:
                continue
            if _NEW_RE.search(ch):
                return code[:m.start()].count("\n") + 1
    if sys.version_info < (3, 12):
        return None
    for node in ast.walk(tree):
        if type(node).__name__ == "TypeAlias" or getattr(node, "type_params", None):
            return node.lineno
    return _fstring_311(code) if "f" in code.lower() else None


def _names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.keyword):
        return [node.arg or ""]
    if isinstance(node, ast.alias):
        return [node.name, node.asname or ""]
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return list(node.names)
    return []


def _fstring_311(code: str) -> Optional[int]:
    """On 3.12+: the line of the first f-string that 3.11's tokenizer and f-string parser reject (an expression
    part with a backslash, a comment, the enclosing quote, a newline in a one-quote string, or fields nested in a
    format spec more than 2 deep), or None."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    lines = code.splitlines(keepends=True)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln))
    depth, start = 0, (0, 0)
    for tok in tokens:
        name = tokenize.tok_name[tok.type]
        if name == "FSTRING_START":
            if depth == 0:
                start = tok.start
            depth += 1
        elif name == "FSTRING_END":
            depth -= 1
            if depth == 0:
                text = code[offsets[start[0] - 1] + start[1]:offsets[tok.end[0] - 1] + tok.end[1]]
                if not _old_fstring_ok(text):
                    return start[0]
    return None


def _old_fstring_ok(text: str) -> bool:
    prefix = re.match(r"[A-Za-z]*", text).group()  # type: ignore[union-attr]
    i = len(prefix)
    quote = text[i:i + 3] if text[i:i + 3] in ('"""', "'''") else text[i:i + 1]
    j = i + len(quote)
    while j < len(text):  # the old tokenizer: the string ends at the first unescaped closing quote
        if text[j] == "\\":
            j += 2
            continue
        if len(quote) == 1 and text[j] == "\n":
            return False
        if text.startswith(quote, j):
            break
        j += 1
    if j + len(quote) != len(text):
        return False
    return _old_fields_ok(text[i + len(quote):j], 0)


def _old_fields_ok(body: str, level: int) -> bool:
    """3.11's f-string body rules over ``body`` (the text between the quotes, or a format spec at ``level``)."""
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c in "{}" and level == 0 and body[i + 1:i + 2] == c:
            i += 2
            continue
        if c != "{":
            i += 1
            continue
        if level >= 2:
            return False
        i += 1
        nest, quote = 0, ""
        while i < n:
            c = body[i]
            if c == "\\":
                return False
            if quote:
                if body.startswith(quote, i):
                    i += len(quote)
                    quote = ""
                else:
                    i += 1
                continue
            if c in "'\"":
                quote = body[i:i + 3] if body[i:i + 3] in ("'''", '"""') else c
                i += len(quote)
                continue
            if c == "#":
                return False
            if c in "([{":
                nest += 1
            elif c in ")]}" and nest:
                nest -= 1
            elif nest == 0 and (c in "}:" or c == "!" and body[i + 1:i + 2] != "="):
                break
            i += 1
        if i >= n or quote:
            return False
        if body[i] == "!":
            i += 2
        if i < n and body[i] == ":":
            spec_start, nest = i + 1, 0
            i += 1
            while i < n and (body[i] != "}" or nest):
                nest += {"{": 1, "}": -1}.get(body[i], 0)
                i += 1
            if not _old_fields_ok(body[spec_start:i], level + 1):
                return False
        i += 1
    return True


# ------------------------------------------------------------------------------------------ runtime errors

# CPython messages worded differently by version (3.11 / 3.12 / 3.13), rewritten to one text
_CANONICAL = [
    (re.compile(r"float modulo( by zero)?"), "float modulo by zero"),
    (re.compile(r"\(34, '[^']*'\)"), "(34, 'Numerical result out of range')"),  # ERANGE in the C library's words
    (re.compile(r"float divmod\(\)( by zero)?"), "float divmod() by zero"),
    (re.compile(r"(\w+)\(\) takes at least (\d+) arguments? \((\d+) given\)"),
     r"\1() takes at least \2 argument(s) (\3 given)"),
    (re.compile(r"(\w+) expected at least (\d+) arguments?, got (\d+)"),
     r"\1() takes at least \2 argument(s) (\3 given)"),
    (re.compile(r"(\w+) expected at most (\d+) arguments?, got (\d+)"),
     r"\1() takes at most \2 argument(s) (\3 given)"),
    (re.compile(r"(\w+)\(\) takes at most (\d+) arguments? \((\d+) given\)"),
     r"\1() takes at most \2 argument(s) (\3 given)"),
    (re.compile(r"(?:\w+\(\) argument \d+ )?must be (str|int|str or None|str or a tuple of str), not (\w+)"),
     r"argument must be \1, not \2"),
]


def exception_text(e: BaseException, key_repr: Any) -> str:
    """The observation text of a Python error the program caused: ``Type: message``, the message bounded and,
    where CPython's wording depends on its version, rewritten from a fixed table. ``key_repr(x)`` gives a
    KeyError key's repr."""
    try:
        if isinstance(e, KeyError) and len(e.args) == 1:
            text = key_repr(e.args[0])
        else:
            text = str(e).encode("utf-8", "backslashreplace").decode("utf-8")  # assert 0, chr(0xd800)
            for pattern, repl in _CANONICAL:
                if pattern.fullmatch(text):
                    text = pattern.sub(repl, text)
                    break
    except Exception:
        text = ""
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
