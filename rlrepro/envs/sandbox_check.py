"""The static half of the Python sandbox: parse a program and refuse, before anything runs, syntax outside the
whitelist, names that lead to files, processes, the network or introspection, attribute names starting with
``_``, and imports other than ``math`` and ``fractions``; and each function's scoping (which names are local).
"""
from __future__ import annotations

import ast
import re

from .sandbox_compat import parse_source, syntax_error
from .sandbox_methods import MODULES
from .sandbox_values import Refused, SandboxError, SandboxLimits

__all__ = ["FORBIDDEN_NAMES", "parse_program", "names_bound"]

# Names a program may not mention at all: the ways to files, processes, the network and introspection.
FORBIDDEN_NAMES = frozenset({
    "open", "eval", "exec", "compile", "__import__", "globals", "locals", "vars", "getattr", "setattr",
    "delattr", "hasattr", "input", "breakpoint", "exit", "quit", "help", "dir", "type", "object", "super",
    "memoryview", "bytearray", "bytes", "classmethod", "staticmethod", "property", "id", "hash", "iter", "next",
    "issubclass", "callable", "format", "ascii", "frozenset", "complex", "slice", "os", "sys", "subprocess",
})

_ALLOWED = (
    ast.Module, ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.If, ast.For, ast.While, ast.Break,
    ast.Continue, ast.Pass, ast.FunctionDef, ast.Return, ast.Import, ast.ImportFrom, ast.Global, ast.Assert,
    ast.Delete, ast.Constant, ast.Name, ast.Load, ast.Store, ast.Del, ast.BinOp, ast.UnaryOp, ast.BoolOp,
    ast.Compare, ast.IfExp, ast.Call, ast.keyword, ast.Attribute, ast.Subscript, ast.Slice, ast.List, ast.Tuple,
    ast.Dict, ast.Set, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.comprehension, ast.Lambda,
    ast.arguments, ast.arg, ast.JoinedStr, ast.FormattedValue, ast.Starred, ast.alias, ast.NamedExpr,
    ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.expr_context,
)
_WHY = {
    "ClassDef": "class definitions are not supported", "Try": "try/except is not supported (an error ends the "
    "program and comes back as the observation)", "With": "with is not supported", "Raise": "raise is not "
    "supported", "Yield": "generators (yield) are not supported", "YieldFrom": "generators (yield) are not "
    "supported", "AsyncFunctionDef": "async code is not supported", "Await": "async code is not supported",
    "Nonlocal": "nonlocal is not supported", "Match": "match is not supported",
}


def parse_program(code: str, limits: SandboxLimits) -> ast.Module:
    if type(code) is not str:
        raise Refused(f"the code must be a string, got {type(code).__name__}")
    if len(code) > limits.max_code_chars:
        raise Refused(f"the program has {len(code)} characters, more than max_code_chars={limits.max_code_chars}")
    if re.search(r"\d{601}", code):
        raise Refused("a run of more than 600 digits (an integer literal that long) is not supported")
    try:
        tree = parse_source(code)
    except SyntaxError as e:  # one fixed text: CPython words its syntax errors differently in every version
        raise SandboxError(syntax_error(e.lineno)) from None
    except (RecursionError, MemoryError):
        # building the tree recursed past 3 x sys.getrecursionlimit() levels (a process-wide setting) or the
        # parser's own fixed stack: far deeper than max_depth, so the observation is the one a tree that deep gets
        raise Refused(_too_deep(limits)) from None
    check_program(tree, limits)
    return tree


def _too_deep(limits: SandboxLimits) -> str:
    return f"the program nests more than max_depth={limits.max_depth} levels"


def _check_depth(tree: ast.AST, limits: SandboxLimits) -> None:
    """Refuse a tree deeper than max_depth before any other refusal, the same whether or not the recursion limit
    let ast.parse build it."""
    stack: list[tuple[ast.AST, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth:
            raise Refused(_too_deep(limits))
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def check_program(tree: ast.AST, limits: SandboxLimits) -> None:
    """Refuse, before running anything, syntax outside the whitelist, forbidden names, dunders and imports."""
    _check_depth(tree, limits)
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        name = type(node).__name__
        if not isinstance(node, _ALLOWED):
            raise Refused(_WHY.get(name) or f"{name} is not supported in the sandbox")
        line = f" (line {node.lineno})" if hasattr(node, "lineno") else ""
        if isinstance(node, ast.Name) and (node.id in FORBIDDEN_NAMES or node.id.startswith("__")):
            raise Refused(f"{node.id!r} is not available in the sandbox (no files, processes, network or "
                          f"introspection){line}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise Refused(f"access to the attribute {node.attr!r} is not allowed in the sandbox{line}")
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name not in MODULES:
                    raise Refused(f"import of module {alias.name!r} is not allowed (the sandbox offers only "
                                  f"{', '.join(MODULES)}){line}")
        if isinstance(node, ast.ImportFrom):
            if node.level or node.module not in MODULES:
                raise Refused(f"import from module {node.module!r} is not allowed (the sandbox offers only "
                              f"{', '.join(MODULES)}){line}")
            if any(a.name == "*" for a in node.names):
                raise Refused(f"'from {node.module} import *' is not supported; name what you import{line}")
        if isinstance(node, (ast.FunctionDef, ast.Lambda)):
            a = node.args
            if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs:
                raise Refused(f"*args, **kwargs, keyword-only and positional-only parameters are not supported"
                              f"{line}")
            if isinstance(node, ast.FunctionDef) and node.decorator_list:
                raise Refused(f"decorators are not supported{line}")
        if isinstance(node, ast.Constant) and type(node.value) not in (int, float, str, bool, type(None)):
            raise Refused(f"{type(node.value).__name__} literals are not supported{line}")
        if isinstance(node, ast.comprehension) and node.is_async:
            raise Refused(f"async comprehensions are not supported{line}")
        if isinstance(node, ast.keyword) and node.arg is None:
            raise Refused(f"**mapping in a call is not supported{line}")
        if isinstance(node, (ast.Assign, ast.For, ast.comprehension, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if any(isinstance(x, ast.Starred) for x in ast.walk(t)):
                    raise Refused(f"starred assignment targets (a, *b = ...) are not supported{line}")
        stack.extend(ast.iter_child_nodes(node))


def names_bound(fn: ast.FunctionDef | ast.Lambda) -> tuple[frozenset, frozenset]:
    """(local names, global names) of a function: its parameters and what its body binds, outside nested
    functions and comprehensions (Python's scoping rule)."""
    local = {a.arg for a in fn.args.args}
    glob: set[str] = set()
    if isinstance(fn, ast.Lambda):
        return frozenset(local), frozenset()
    stack: list[ast.AST] = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Global):
            glob.update(node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            local.add(node.id)
        elif isinstance(node, ast.FunctionDef):
            local.add(node.name)
            stack.extend(node.args.defaults)
            continue
        elif isinstance(node, ast.alias):
            local.add((node.asname or node.name).split(".")[0])
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        stack.extend(ast.iter_child_nodes(node))
    return frozenset(local - glob), frozenset(glob)
