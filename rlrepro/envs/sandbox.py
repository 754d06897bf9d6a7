"""A deterministic Python sandbox for ReTool / SimpleTIR-style tool calls: :func:`run_python`.

The program is parsed with :mod:`ast`, checked against a whitelist of syntax, and run by an interpreter written
here (no ``exec``, no ``eval``, no compiled code object): every statement and expression it evaluates costs one
step, bulk work (sorting, joining, big-int products) costs steps by size, and every value it creates is checked
against size caps and a cumulative memory budget (:mod:`rlrepro.envs.sandbox_values`). A program that runs out
of steps, memory or nesting stops with an error observation; none of it depends on a clock, so a slow machine
gives the same result. The run happens on a fresh thread so that CPython's recursion counter starts from the
same depth whoever calls it.

What the program can use: arithmetic, comparisons, ``and/or/not``, assignments (unpacking, subscripts,
augmented), ``if/for/while/break/continue/pass``, ``def`` and ``lambda`` (positional and keyword arguments with
defaults; closures; ``global``), ``return``, ``assert``, ``del``, list/dict/set/tuple displays and comprehensions,
generator expressions, f-strings, the builtins of :mod:`~rlrepro.envs.sandbox_builtins`, the methods of
:mod:`~rlrepro.envs.sandbox_methods`, and ``import math`` / ``import fractions`` (``from ... import ...``).
Not offered: other imports, ``open`` and every file, network or process function, attribute names that start
with ``_``, classes, ``try``, ``with``, ``raise``, ``yield``, ``async``, ``nonlocal``, ``*args``/``**kwargs``
parameters. See docs/ENVS.md for what this does and does not protect against.
"""
from __future__ import annotations

import ast
import threading
from dataclasses import dataclass
from typing import Any, Optional

from .sandbox_builtins import Builtin, BoundMethod, LazyIter, iterate, make_builtins
from .sandbox_check import FORBIDDEN_NAMES, names_bound, parse_program
from .sandbox_compat import exception_text
from .sandbox_methods import get_attribute, make_module
from .sandbox_ops import binop, compare, del_item, format_field, get_item, set_item, unaryop
from .sandbox_values import (Meter, Refused, SandboxError, SandboxLimits, SandboxSet, UserFunction, to_repr,
                             to_str)

__all__ = ["run_python", "SandboxResult", "SandboxLimits", "FORBIDDEN_NAMES"]

@dataclass(frozen=True)
class SandboxResult:
    """What one run gave: ``stdout`` (at most ``max_output_bytes`` of UTF-8), ``error`` (None, or the text after
    ``Error: ``), the steps and memory charged, and how many bytes the program printed in all."""
    stdout: str
    error: Optional[str]
    steps: int
    memory: int
    output_bytes: int

    @property
    def truncated(self) -> bool:
        return self.output_bytes > len(self.stdout.encode("utf-8"))

    def observation(self) -> str:
        """The text the model reads: stdout, a truncation note, the error; ``(no output)`` when all are empty."""
        text = self.stdout
        if self.truncated:
            text += ("" if not text or text.endswith("\n") else "\n") + \
                f"[output truncated: the program printed {self.output_bytes} bytes, the first " \
                f"{len(self.stdout.encode('utf-8'))} are shown]\n"
        if self.error is not None:
            text += ("" if not text or text.endswith("\n") else "\n") + f"Error: {self.error}"
        text = text.rstrip("\n")
        return text if text else "(no output)"


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in the sandbox and return what it printed and how it ended. Never raises for anything the
    program does; the same code and limits give the same result in every run and process."""
    limits = limits if limits is not None else SandboxLimits()
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(_run(code, limits))
        except BaseException as e:  # MemoryError and the like: handed to the caller, not turned into text
            box.append(e)

    thread = threading.Thread(target=target, name="rlrepro-sandbox", daemon=True)
    thread.start()
    thread.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


class _Return(Exception):
    def __init__(self, value: Any) -> None:
        self.value = value


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


def _run(code: str, limits: SandboxLimits) -> SandboxResult:
    interp = _Interpreter(limits)
    error: Optional[str] = None
    try:
        tree = parse_program(code, limits)
        interp.run(tree)
    except SandboxError as e:
        error = str(e) + interp.where()
    except _Return:
        error = "SyntaxError: 'return' outside function" + interp.where()
    except (_Break, _Continue):
        error = "SyntaxError: 'break' or 'continue' outside a loop" + interp.where()
    except RecursionError:
        error = "RecursionError: the program nests too deeply" + interp.where()
    except MemoryError:  # the machine's memory, not the program's limits: never an observation
        raise
    except Exception as e:
        error = _exception_text(e, interp.meter) + interp.where()
    return SandboxResult(stdout=interp.stdout(), error=error, steps=interp.meter.steps, memory=interp.meter.memory,
                         output_bytes=interp.out_bytes)


def _exception_text(e: Exception, meter: Meter) -> str:
    return exception_text(e, lambda key: to_repr(key, Meter(meter.limits)))


class _Scope:
    __slots__ = ("kind", "vars", "parent", "fn")

    def __init__(self, kind: str, variables: dict, parent: "_Scope | None", fn: UserFunction | None) -> None:
        self.kind, self.vars, self.parent, self.fn = kind, variables, parent, fn


class _Interpreter:
    def __init__(self, limits: SandboxLimits) -> None:
        self.limits = limits
        self.meter = Meter(limits)
        self.builtins = make_builtins()
        self.globals = _Scope("module", {}, None, None)
        self.modules: dict[str, Any] = {}
        self.lineno = 0
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.kept = 0
        self.fn_names: dict[int, tuple[frozenset, frozenset]] = {}
        self.stmt = {getattr(ast, n[3:]): getattr(self, n) for n in dir(self) if n.startswith("_s_")}
        self.expr = {getattr(ast, n[3:]): getattr(self, n) for n in dir(self) if n.startswith("_e_")}

    # ---- services the builtins use

    def write(self, text: str) -> None:
        # a lone surrogate (chr(0xd800)) cannot be UTF-8: it is printed as its escape, "\\ud800" (CPython's print
        # would raise), so the bytes counted are the bytes shown
        data = text.encode("utf-8", "backslashreplace")
        self.meter.bulk(len(data))
        self.out_bytes += len(data)
        room = self.limits.max_output_bytes - self.kept
        if room > 0:
            self.out.append(data[:room])
            self.kept += min(room, len(data))

    def stdout(self) -> str:
        return b"".join(self.out).decode("utf-8", "ignore")

    def where(self) -> str:
        return f" (line {self.lineno})" if self.lineno else ""

    def truth(self, v: Any) -> bool:
        return bool(v)

    def call(self, fn: Any, args: list, kwargs: dict) -> Any:
        t = type(fn)
        if t is UserFunction:
            return self._call_user(fn, args, kwargs)
        if t is Builtin:
            return fn.fn(self, args, kwargs)
        if t is BoundMethod:
            return fn.fn(self, fn.obj, args, kwargs)
        raise TypeError(f"'{t.__name__}' object is not callable")

    # ---- running

    def run(self, tree: ast.Module) -> None:
        body = tree.body
        for i, node in enumerate(body):
            if i == len(body) - 1 and isinstance(node, ast.Expr):
                self.meter.step()
                self.lineno = node.lineno
                value = self._eval(node.value, self.globals)
                if value is not None:  # the last expression's value is shown, as a notebook cell does
                    self.write(to_repr(value, self.meter) + "\n")
            else:
                self._exec(node, self.globals)

    def _enter(self) -> None:
        self.meter.enter()

    def _exec(self, node: ast.stmt, scope: _Scope) -> None:
        self.meter.step()
        self.lineno = node.lineno
        self._enter()
        try:
            self.stmt[type(node)](node, scope)
        finally:
            self.meter.depth -= 1

    def _block(self, body: list[ast.stmt], scope: _Scope) -> None:
        for node in body:
            self._exec(node, scope)

    def _eval(self, node: ast.expr, scope: _Scope) -> Any:
        self.meter.step()
        self._enter()
        try:
            return self.expr[type(node)](node, scope)
        finally:
            self.meter.depth -= 1

    # ---- names

    def _load(self, scope: _Scope, name: str) -> Any:
        s: _Scope | None = scope
        innermost = True
        while s is not None and s.kind != "module":
            if s.kind == "func" and name in s.fn.global_names:  # type: ignore[union-attr]
                break
            if name in s.vars:
                return s.vars[name]
            if s.kind == "func" and innermost and name in s.fn.local_names:  # type: ignore[union-attr]
                raise UnboundLocalError(f"cannot access local variable '{name}' where it is not associated "
                                        f"with a value")
            if s.kind == "func":
                innermost = False
            s = s.parent
        if name in self.globals.vars:
            return self.globals.vars[name]
        if name in self.builtins:
            return self.builtins[name]
        raise NameError(f"name '{name}' is not defined")

    def _store(self, scope: _Scope, name: str, value: Any) -> None:
        if scope.kind == "func" and name in scope.fn.global_names:  # type: ignore[union-attr]
            self.globals.vars[name] = value
        else:
            scope.vars[name] = value

    def _assign(self, target: ast.expr, value: Any, scope: _Scope) -> None:
        if isinstance(target, ast.Name):
            self._store(scope, target.id, value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            items = list(iterate(self.meter, value))
            n = len(target.elts)
            if len(items) != n:
                raise ValueError(f"not enough values to unpack (expected {n}, got {len(items)})"
                                 if len(items) < n else f"too many values to unpack (expected {n})")
            for t, v in zip(target.elts, items):
                self._assign(t, v, scope)
        elif isinstance(target, ast.Subscript):
            set_item(self.meter, self._eval(target.value, scope), self._eval(target.slice, scope), value)
        else:
            raise Refused("assigning to attributes is not supported")

    # ---- statements

    def _s_Expr(self, node: ast.Expr, scope: _Scope) -> None:
        self._eval(node.value, scope)

    def _s_Assign(self, node: ast.Assign, scope: _Scope) -> None:
        value = self._eval(node.value, scope)
        for target in node.targets:
            self._assign(target, value, scope)

    def _s_AnnAssign(self, node: ast.AnnAssign, scope: _Scope) -> None:
        if node.value is not None:
            self._assign(node.target, self._eval(node.value, scope), scope)

    def _augment(self, op: str, current: Any, value: Any) -> Any:
        if type(current) is list and op == "Add":
            items = list(iterate(self.meter, value))
            self.meter.length(len(current) + len(items), "list")
            self.meter.alloc(8 * len(items))
            current.extend(items)
            return current
        return binop(self.meter, op, current, value)

    def _s_AugAssign(self, node: ast.AugAssign, scope: _Scope) -> None:
        op = type(node.op).__name__
        target = node.target
        if isinstance(target, ast.Name):
            value = self._eval(node.value, scope)
            self._store(scope, target.id, self._augment(op, self._load(scope, target.id), value))
        elif isinstance(target, ast.Subscript):
            obj, index = self._eval(target.value, scope), self._eval(target.slice, scope)
            value = self._eval(node.value, scope)
            set_item(self.meter, obj, index, self._augment(op, get_item(self.meter, obj, index), value))
        else:
            raise Refused("assigning to attributes is not supported")

    def _s_If(self, node: ast.If, scope: _Scope) -> None:
        self._block(node.body if self.truth(self._eval(node.test, scope)) else node.orelse, scope)

    def _loop_body(self, body: list[ast.stmt], scope: _Scope) -> bool:
        """Run one iteration; False when it ended with break."""
        try:
            self._block(body, scope)
        except _Break:
            return False
        except _Continue:
            pass
        return True

    def _s_For(self, node: ast.For, scope: _Scope) -> None:
        for item in iterate(self.meter, self._eval(node.iter, scope)):
            self._assign(node.target, item, scope)
            if not self._loop_body(node.body, scope):
                return
        self._block(node.orelse, scope)

    def _s_While(self, node: ast.While, scope: _Scope) -> None:
        while self.truth(self._eval(node.test, scope)):
            if not self._loop_body(node.body, scope):
                return
        self._block(node.orelse, scope)

    def _s_Break(self, node: ast.Break, scope: _Scope) -> None:
        raise _Break()

    def _s_Continue(self, node: ast.Continue, scope: _Scope) -> None:
        raise _Continue()

    def _s_Pass(self, node: ast.Pass, scope: _Scope) -> None:
        pass

    def _function(self, node: ast.FunctionDef | ast.Lambda, name: str, scope: _Scope) -> UserFunction:
        defaults = [self._eval(d, scope) for d in node.args.defaults]
        if id(node) not in self.fn_names:
            self.fn_names[id(node)] = names_bound(node)
        local, glob = self.fn_names[id(node)]
        closure = None if scope.kind == "module" else scope
        return UserFunction(name, node, defaults, closure, local, glob)

    def _s_FunctionDef(self, node: ast.FunctionDef, scope: _Scope) -> None:
        self._store(scope, node.name, self._function(node, node.name, scope))

    def _s_Return(self, node: ast.Return, scope: _Scope) -> None:
        raise _Return(None if node.value is None else self._eval(node.value, scope))

    def _module(self, name: str) -> Any:
        if name not in self.modules:
            self.modules[name] = make_module(name)
        return self.modules[name]

    def _s_Import(self, node: ast.Import, scope: _Scope) -> None:
        for alias in node.names:
            self._store(scope, alias.asname or alias.name, self._module(alias.name))

    def _s_ImportFrom(self, node: ast.ImportFrom, scope: _Scope) -> None:
        module = self._module(node.module)  # type: ignore[arg-type]
        for alias in node.names:
            if alias.name not in module.members:
                raise ImportError(f"cannot import name {alias.name!r} from {node.module!r} (in the sandbox)")
            self._store(scope, alias.asname or alias.name, module.members[alias.name])

    def _s_Global(self, node: ast.Global, scope: _Scope) -> None:
        pass  # collected statically by names_bound

    def _s_Assert(self, node: ast.Assert, scope: _Scope) -> None:
        if not self.truth(self._eval(node.test, scope)):
            raise AssertionError("" if node.msg is None else to_str(self._eval(node.msg, scope), self.meter))

    def _s_Delete(self, node: ast.Delete, scope: _Scope) -> None:
        for target in node.targets:
            if isinstance(target, ast.Name):
                if target.id not in scope.vars:
                    raise NameError(f"name '{target.id}' is not defined")
                del scope.vars[target.id]
            elif isinstance(target, ast.Subscript):
                del_item(self.meter, self._eval(target.value, scope), self._eval(target.slice, scope))
            else:
                raise Refused("deleting attributes is not supported")

    # ---- calls

    def _call_user(self, fn: UserFunction, args: list, kwargs: dict) -> Any:
        node = fn.node
        params = [a.arg for a in node.args.args]
        if len(args) > len(params):
            raise TypeError(f"{fn.name}() takes {len(params)} positional arguments but {len(args)} were given")
        bound = dict(zip(params, args))
        for k, v in kwargs.items():
            if k not in params:
                raise TypeError(f"{fn.name}() got an unexpected keyword argument '{k}'")
            if k in bound:
                raise TypeError(f"{fn.name}() got multiple values for argument '{k}'")
            bound[k] = v
        for p, d in zip(params[len(params) - len(fn.defaults):], fn.defaults):
            bound.setdefault(p, d)
        missing = [p for p in params if p not in bound]
        if missing:
            raise TypeError(f"{fn.name}() missing {len(missing)} required positional argument"
                            f"{'s' if len(missing) > 1 else ''}: {', '.join(repr(m) for m in missing)}")
        scope = _Scope("func", bound, fn.closure, fn)
        caller_line = self.lineno
        self._enter()
        try:
            if isinstance(node, ast.Lambda):
                value = self._eval(node.body, scope)
            else:
                try:
                    self._block(node.body, scope)
                    value = None
                except _Return as r:
                    value = r.value
        finally:
            self.meter.depth -= 1
        self.lineno = caller_line  # an error later in the calling statement names its line, not the callee's last
        return value

    def _e_Call(self, node: ast.Call, scope: _Scope) -> Any:
        fn = self._eval(node.func, scope)
        args: list = []
        for a in node.args:
            if isinstance(a, ast.Starred):
                args.extend(iterate(self.meter, self._eval(a.value, scope)))
            else:
                args.append(self._eval(a, scope))
        kwargs = {kw.arg: self._eval(kw.value, scope) for kw in node.keywords}
        return self.call(fn, args, kwargs)

    # ---- expressions

    def _e_Constant(self, node: ast.Constant, scope: _Scope) -> Any:
        return node.value

    def _e_Name(self, node: ast.Name, scope: _Scope) -> Any:
        return self._load(scope, node.id)

    def _e_NamedExpr(self, node: ast.NamedExpr, scope: _Scope) -> Any:
        value = self._eval(node.value, scope)
        self._store(scope, node.target.id, value)
        return value

    def _e_BinOp(self, node: ast.BinOp, scope: _Scope) -> Any:
        left = self._eval(node.left, scope)
        return binop(self.meter, type(node.op).__name__, left, self._eval(node.right, scope))

    def _e_UnaryOp(self, node: ast.UnaryOp, scope: _Scope) -> Any:
        value = self._eval(node.operand, scope)
        if isinstance(node.op, ast.Not):
            return not self.truth(value)
        return unaryop(self.meter, type(node.op).__name__, value)

    def _e_BoolOp(self, node: ast.BoolOp, scope: _Scope) -> Any:
        is_and = isinstance(node.op, ast.And)
        value = None
        for v in node.values:
            value = self._eval(v, scope)
            if self.truth(value) != is_and:
                return value
        return value

    def _e_Compare(self, node: ast.Compare, scope: _Scope) -> bool:
        left = self._eval(node.left, scope)
        for op, comp in zip(node.ops, node.comparators):
            right = self._eval(comp, scope)
            if not compare(self.meter, type(op).__name__, left, right):
                return False
            left = right
        return True

    def _e_IfExp(self, node: ast.IfExp, scope: _Scope) -> Any:
        return self._eval(node.body if self.truth(self._eval(node.test, scope)) else node.orelse, scope)

    def _e_Attribute(self, node: ast.Attribute, scope: _Scope) -> Any:
        return get_attribute(self._eval(node.value, scope), node.attr)

    def _e_Subscript(self, node: ast.Subscript, scope: _Scope) -> Any:
        obj = self._eval(node.value, scope)
        return get_item(self.meter, obj, self._eval(node.slice, scope))

    def _e_Slice(self, node: ast.Slice, scope: _Scope) -> slice:
        parts = [None if p is None else self._eval(p, scope) for p in (node.lower, node.upper, node.step)]
        for p in parts:
            if p is not None and type(p) not in (int, bool):
                raise TypeError("slice indices must be integers or None")
        return slice(*parts)

    def _items(self, elts: list[ast.expr], scope: _Scope) -> list:
        out: list = []
        for e in elts:
            if isinstance(e, ast.Starred):
                out.extend(iterate(self.meter, self._eval(e.value, scope)))
            else:
                out.append(self._eval(e, scope))
            self.meter.length(len(out), "list")
        return out

    def _e_List(self, node: ast.List, scope: _Scope) -> list:
        return self.meter.value(self._items(node.elts, scope))

    def _e_Tuple(self, node: ast.Tuple, scope: _Scope) -> tuple:
        return self.meter.value(tuple(self._items(node.elts, scope)))

    def _e_Set(self, node: ast.Set, scope: _Scope) -> SandboxSet:
        items = self._items(node.elts, scope)
        for x in items:
            self.meter.nesting(x)
        return self.meter.value(SandboxSet(items))

    def _e_Dict(self, node: ast.Dict, scope: _Scope) -> dict:
        out: dict = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                src = self._eval(v, scope)
                if type(src) is not dict:
                    raise TypeError(f"'{type(src).__name__}' object is not a mapping")
                self.meter.bulk(len(src))
                out.update(src)
            else:
                key = self._eval(k, scope)
                self.meter.nesting(key)
                out[key] = self._eval(v, scope)
            self.meter.length(len(out), "dict")
        return self.meter.value(out)

    def _comprehension(self, gens: list[ast.comprehension], scope: _Scope, first: Any) -> Any:
        """Yield the comprehension's scope once per combination that passes the filters."""
        inner = _Scope("comp", {}, scope, None)

        def loop(i: int, source: Any) -> Any:
            gen = gens[i]
            for item in source:
                self._assign(gen.target, item, inner)
                if all(self.truth(self._eval(cond, inner)) for cond in gen.ifs):
                    if i + 1 < len(gens):
                        yield from loop(i + 1, iterate(self.meter, self._eval(gens[i + 1].iter, inner)))
                    else:
                        yield inner
        return loop(0, first)

    def _first(self, node: Any, scope: _Scope) -> Any:
        return iterate(self.meter, self._first_value(node, scope))

    def _first_value(self, node: Any, scope: _Scope) -> Any:
        return self._eval(node.generators[0].iter, scope)

    def _e_ListComp(self, node: ast.ListComp, scope: _Scope) -> list:
        out: list = []
        for inner in self._comprehension(node.generators, scope, self._first(node, scope)):
            out.append(self._eval(node.elt, inner))
            self.meter.length(len(out), "list")
        return self.meter.value(out)

    def _e_SetComp(self, node: ast.SetComp, scope: _Scope) -> SandboxSet:
        out = SandboxSet()
        for inner in self._comprehension(node.generators, scope, self._first(node, scope)):
            x = self._eval(node.elt, inner)
            self.meter.nesting(x)
            out.add(x)
            self.meter.length(len(out), "set")
        return self.meter.value(out)

    def _e_DictComp(self, node: ast.DictComp, scope: _Scope) -> dict:
        out: dict = {}
        for inner in self._comprehension(node.generators, scope, self._first(node, scope)):
            key = self._eval(node.key, inner)
            self.meter.nesting(key)
            out[key] = self._eval(node.value, inner)
            self.meter.length(len(out), "dict")
        return self.meter.value(out)

    def _e_GeneratorExp(self, node: ast.GeneratorExp, scope: _Scope) -> LazyIter:
        source = self._first_value(node, scope)
        scopes = self._comprehension(node.generators, scope, iterate(self.meter, source))
        return LazyIter("generator", (self._eval(node.elt, inner) for inner in scopes), [source])

    def _e_Lambda(self, node: ast.Lambda, scope: _Scope) -> UserFunction:
        return self._function(node, "<lambda>", scope)

    def _e_JoinedStr(self, node: ast.JoinedStr, scope: _Scope) -> str:
        parts: list[str] = []
        size = 0
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(v.value)
            else:
                spec = "" if v.format_spec is None else self._eval(v.format_spec, scope)
                parts.append(format_field(self.meter, self._eval(v.value, scope), v.conversion, spec))
            size += len(parts[-1])
            self.meter.length(size, "str")
        return self.meter.value("".join(parts))

    def _e_Starred(self, node: ast.Starred, scope: _Scope) -> Any:
        raise Refused("a starred expression is only supported in calls and list, tuple or set displays")
