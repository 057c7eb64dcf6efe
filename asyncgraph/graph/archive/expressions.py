"""The allowlists of symbolic expressions and guards a graph JSON may carry.

torch `sympify`s symbolic expressions (`expr_str`, range constraint keys), which evaluates
them as Python, and compiles `guards_code` with `exec`. Each is parsed here with `ast` (never
evaluated) and let through only when every node of it is on an allowlist: sympy and
torch.utils._sympy constructors, symbols and numbers for expressions; comparisons of input
sizes, strides and constants for guards.
"""

from __future__ import annotations

import ast
import builtins
import re

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\Z")

_SYMPY_CALLS = frozenset({
    "Symbol", "Dummy", "Integer", "Float", "Rational", "Max", "Min", "Eq", "Ne", "Lt", "Le",
    "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "Equality",
    "Unequality", "And", "Or", "Not", "Xor", "Abs", "floor", "ceiling", "sqrt", "Pow", "Mul",
    "Add", "Mod", "Piecewise", "ITE", "Sum",
    # torch.utils._sympy.functions
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt",
    "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt",
    "RoundDecimal", "ToFloat", "Identity", "BitwiseFn_bitwise_and", "BitwiseFn_bitwise_or",
    "BitwiseFn_bitwise_xor", "OpaqueUnaryFn_sqrt", "OpaqueUnaryFn_exp", "OpaqueUnaryFn_log",
    "OpaqueUnaryFn_log2", "OpaqueUnaryFn_cos", "OpaqueUnaryFn_sin", "OpaqueUnaryFn_tan",
    "OpaqueUnaryFn_cosh", "OpaqueUnaryFn_sinh", "OpaqueUnaryFn_tanh", "OpaqueUnaryFn_acos",
    "OpaqueUnaryFn_asin", "OpaqueUnaryFn_atan", "OpaqueUnaryFn_asinh",
})
_SYMPY_NAMES = frozenset({"oo", "zoo", "nan", "true", "false", "pi", "E", "I", "int_oo"})
_ASSUMPTIONS = frozenset({
    "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite",
    "infinite", "nonzero", "zero", "rational", "even", "odd", "commutative", "prime",
    "composite", "extended_real", "precision",
})
_BUILTIN_NAMES = frozenset(dir(builtins))
_ARITH = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
          ast.LShift, ast.RShift, ast.BitAnd, ast.BitOr, ast.BitXor)


def _parse(text: str) -> ast.expr | None:
    if len(text) > 10_000:
        return None
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _symbol_name(name: str) -> bool:
    return bool(_IDENT.match(name)) and "__" not in name


# -- symbolic expressions -------------------------------------------------------------------------


def is_safe_sym_expr(text: str) -> bool:
    """A sympy expression built from allowlisted constructors, symbols and numbers only."""
    tree = _parse(text)
    return tree is not None and _sym_node(tree)


def _sym_node(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float, bool)
    if isinstance(node, ast.Name):
        if node.id in _SYMPY_NAMES or node.id in _SYMPY_CALLS:
            return True
        return _symbol_name(node.id) and node.id not in _BUILTIN_NAMES
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _ARITH) and _sym_node(node.left) and _sym_node(node.right)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd, ast.Not, ast.Invert)) and _sym_node(
            node.operand
        )
    if isinstance(node, ast.Compare):
        return _sym_node(node.left) and all(_sym_node(c) for c in node.comparators)
    if isinstance(node, ast.BoolOp):
        return all(_sym_node(v) for v in node.values)
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _SYMPY_CALLS:
            return False
        for kw in node.keywords:
            if kw.arg not in _ASSUMPTIONS or not isinstance(kw.value, ast.Constant):
                return False
            if type(kw.value.value) not in (bool, int):
                return False
        for arg in node.args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if node.func.id in ("Symbol", "Dummy") and _symbol_name(arg.value):
                    continue
                if node.func.id in ("Float", "Integer", "Rational") and _NUMBER.match(arg.value):
                    continue
                return False
            if not _sym_node(arg):
                return False
        return True
    return False


# -- guards ---------------------------------------------------------------------------------------

_GUARD_ATTRS = frozenset({"size", "stride", "storage_offset", "dim", "numel", "shape"})
_GUARD_NAMES = frozenset({"L", "math", "inf", "True", "False", "None"})
_GUARD_CALLS = frozenset({"max", "min", "abs", "int", "float", "round", "bool"})
_GUARD_MATH = frozenset({"floor", "ceil", "trunc", "sqrt", "isnan", "isinf", "isfinite",
                         "inf", "nan", "log", "exp", "pow"})


def is_safe_guard(text: str) -> bool:
    """A guard such as `L['x'].size()[0] == L['y'].size()[0]` and nothing more."""
    tree = _parse(text)
    return tree is not None and _guard_node(tree)


def _guard_node(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, str):
            return _symbol_name(value)
        return value is None or type(value) in (int, float, bool)
    if isinstance(node, ast.Name):
        return node.id in _GUARD_NAMES
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "math":
            return node.attr in _GUARD_MATH
        return node.attr in _GUARD_ATTRS and _guard_node(node.value)
    if isinstance(node, ast.Subscript):
        return _guard_node(node.value) and _guard_node(node.slice)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):
            callable_ok = func.id in _GUARD_CALLS
        elif isinstance(func, ast.Attribute):
            if isinstance(func.value, ast.Name) and func.value.id == "math":
                callable_ok = func.attr in _GUARD_MATH
            else:
                callable_ok = func.attr in _GUARD_ATTRS and _guard_node(func.value)
        else:
            callable_ok = False
        return callable_ok and not node.keywords and all(_guard_node(a) for a in node.args)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _ARITH) and _guard_node(node.left) and _guard_node(node.right)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)) and _guard_node(node.operand)
    if isinstance(node, ast.Compare):
        return _guard_node(node.left) and all(_guard_node(c) for c in node.comparators)
    if isinstance(node, ast.BoolOp):
        return all(_guard_node(v) for v in node.values)
    return False
