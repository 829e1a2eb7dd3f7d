"""csrc/cbgen.h read without a C compiler, and the check that ctypes' signatures agree with it.

ctypes trusts whatever argtypes and restype it is given: an int64_t passed as c_int, a float as
c_double or an argument left out is not an error but a wrong value or a stray pointer in the
kernel. The C files include cbgen.h, so the compiler holds every definition to its declaration
there; this module holds build.py's ctypes signatures (and NativeDecoder's Structures) to the
same declarations, so the two sides meet in one file.

The parser reads the subset of C that cbgen.h keeps to, and refuses anything else (HeaderError
names the statement or the type), so a declaration it cannot read is never skipped:

    // ... and /* ... */      comments, dropped
    #...                      preprocessor lines, dropped
    typedef struct { const float *a, *b; int64_t n; ... } name;
    type name(type arg, ...);   or   type name(void);

where a type is one of _C_TYPES or a struct typedef from the header, optionally const, with
`*` for a pointer. Each C type is compared with its ctypes type by what the call passes:

    void                    restype None
    float, double           c_float, c_double
    [u]intN_t, int, size_t  an integer ctypes type of the same size and signedness
                            (c_long for int64_t on LP64: ctypes makes them one type)
    any pointer             c_void_p, c_char_p, or POINTER(t) with t agreeing with the
                            pointee (a struct pointee: a Structure with the same fields)
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CTypesType = Any
"""A ctypes type as argtypes and restype take it (None for void); ctypes has no common base."""

Signature = tuple[CTypesType, Sequence[CTypesType]]
"""(restype, argtypes) of one function."""

_C_TYPES: Mapping[str, CTypesType] = {
    "void": None,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "int": ctypes.c_int,
    "size_t": ctypes.c_size_t,
    "int8_t": ctypes.c_int8,
    "uint8_t": ctypes.c_uint8,
    "int16_t": ctypes.c_int16,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "uint16_t": ctypes.c_uint16,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
}
"""The scalar C types the parser knows, each with the ctypes type that passes it."""

_INT_CODES = "bBhHiIlLqQ"
"""ctypes' _type_ codes of its integer types (lower case: signed)."""


class HeaderError(ValueError):
    """The header holds a statement or a type outside the subset this module reads."""


class SignatureMismatch(TypeError):
    """ctypes' signatures (or Structures) disagree with the header: every difference, each
    naming the function (or struct) and the argument (or field)."""

    def __init__(self, what: str, problems: Sequence[str]) -> None:
        super().__init__(f"{what} disagree with cbgen.h:\n  " + "\n  ".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True)
class CType:
    """A C type as the header spells it: the base name and how many `*` follow it."""

    base: str
    pointers: int = 0

    def __str__(self) -> str:
        return self.base + " " + "*" * self.pointers if self.pointers else self.base


@dataclass(frozen=True)
class Prototype:
    """`restype name(args)`: each argument its type and name ('' where the header gives none)."""

    name: str
    restype: CType
    args: tuple[tuple[CType, str], ...]


@dataclass(frozen=True)
class Header:
    functions: Mapping[str, Prototype]
    structs: Mapping[str, tuple[tuple[CType, str], ...]]
    """typedef name -> its fields in order, each its type and name."""


def parse_header(text: str) -> Header:
    """The prototypes and struct typedefs of a header in the subset the module docstring gives
    (HeaderError on anything else)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^[ \t]*#[^\n]*", " ", text, flags=re.M)
    structs: dict[str, tuple[tuple[CType, str], ...]] = {}

    def struct(m: re.Match[str]) -> str:
        fields = []
        for decl in filter(str.strip, m.group(1).split(";")):
            head = re.match(r"\s*((?:const\s+)?\w+)\s*(.*)$", decl, re.S)
            if head is None:
                raise HeaderError(f"cannot read the field {decl.strip()!r} of {m.group(2)}")
            for declarator in head.group(2).split(","):
                ctype, name = _declaration(f"{head.group(1)} {declarator}", set(structs))
                if not name:
                    raise HeaderError(f"a field of {m.group(2)} has no name: {decl.strip()!r}")
                fields.append((ctype, name))
        structs[m.group(2)] = tuple(fields)
        return " "

    text = re.sub(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", struct, text, flags=re.S)
    functions = {}
    for statement in filter(str.strip, text.split(";")):
        m = re.fullmatch(r"\s*([\w\s]+?[\s*]+)(\w+)\s*\((.*)\)\s*", statement, re.S)
        if m is None:
            raise HeaderError(f"not a prototype: {' '.join(statement.split())!r}")
        restype, _ = _declaration(m.group(1), set(structs))
        params = " ".join(m.group(3).split())
        args = (
            [] if params == "void" else [_declaration(p, set(structs)) for p in params.split(",")]
        )
        if m.group(2) in functions:
            raise HeaderError(f"{m.group(2)} is declared twice")
        functions[m.group(2)] = Prototype(m.group(2), restype, tuple(args))
    return Header(functions, structs)


_TOKEN = re.compile(r"\w+|\*|\S")


def _declaration(text: str, structs: set[str]) -> tuple[CType, str]:
    """'const float *w' -> (CType('float', 1), 'w'); the name may be absent ('int64_t')."""
    tokens = [t for t in _TOKEN.findall(text) if t != "const"]
    words = [t for t in tokens if t != "*"]
    if not words or len(words) > 2 or not all(w.isidentifier() for w in words):
        raise HeaderError(f"cannot read the declaration {' '.join(text.split())!r}")
    if words[0] not in _C_TYPES and words[0] not in structs:
        raise HeaderError(
            f"unknown type {words[0]!r} in {' '.join(text.split())!r}: the header may use "
            f"{', '.join(_C_TYPES)} or its own struct typedefs (c_header._C_TYPES)"
        )
    return CType(words[0], tokens.count("*")), words[1] if len(words) == 2 else ""


def check_signatures(header: Header, signatures: Mapping[str, Signature]) -> None:
    """SignatureMismatch, listing every difference, unless each function of the header has a
    signature in `signatures` (name -> (restype, argtypes)), each signature a function of the
    header, and each return and argument type agrees as the module docstring says."""
    problems = []
    for name in sorted(signatures.keys() - header.functions.keys()):
        problems.append(f"{name}: a ctypes signature, but no declaration in cbgen.h")
    for name in sorted(header.functions.keys() - signatures.keys()):
        problems.append(f"{name}: declared in cbgen.h, but no ctypes signature")
    for name in sorted(header.functions.keys() & signatures.keys()):
        proto, (restype, argtypes) = header.functions[name], signatures[name]
        why = _disagreement(header, proto.restype, restype)
        if why:
            problems.append(f"{name} returns {proto.restype}, ctypes restype {why}")
        if len(argtypes) != len(proto.args):
            problems.append(
                f"{name}: cbgen.h declares {len(proto.args)} arguments, ctypes "
                f"{len(argtypes)} ({_signature_text(proto)})"
            )
            continue
        for i, ((ctype, arg), given) in enumerate(zip(proto.args, argtypes, strict=True), 1):
            why = _disagreement(header, ctype, given)
            if why:
                problems.append(f"{name} argument {i} ({ctype} {arg}): ctypes {why}")
    if problems:
        raise SignatureMismatch("ctypes signatures", problems)


def check_struct(header: Header, name: str, structure: type[ctypes.Structure]) -> None:
    """SignatureMismatch unless the ctypes Structure has the fields of the header's typedef
    `name`: the same names, in the same order, with agreeing types."""
    problems = _struct_problems(header, name, structure)
    if problems:
        raise SignatureMismatch(f"the fields of {structure.__name__}", [problems])


def _struct_problems(header: Header, name: str, structure: type) -> str:
    """'' when structure (a ctypes type) has the fields of the header's struct `name`, else
    what differs."""
    if name not in header.structs:
        return f"cbgen.h has no struct {name}"
    if not isinstance(structure, type) or not issubclass(structure, ctypes.Structure):
        return f"{_name(structure)} is not a Structure, for struct {name}"
    fields = header.structs[name]
    given = list(getattr(structure, "_fields_", []))
    want_names, given_names = [f for _, f in fields], [f[0] for f in given]
    if want_names != given_names:
        return f"{name}'s fields are {want_names}, {structure.__name__}'s {given_names}"
    for (ctype, field), (_, t, *_) in zip(fields, given, strict=True):
        why = _disagreement(header, ctype, t)
        if why:
            return f"{name}.{field} ({ctype}): {structure.__name__} {why}"
    return ""


def _disagreement(header: Header, ctype: CType, given: CTypesType) -> str:
    """'' when the ctypes type `given` passes the C type as the module docstring says, else
    what it is instead ('c_int, a 4-byte signed integer')."""
    if ctype.pointers:
        if given in (ctypes.c_void_p, ctypes.c_char_p):
            return ""
        if isinstance(given, type) and issubclass(given, ctypes._Pointer):
            pointee = CType(ctype.base, ctype.pointers - 1)
            if pointee.pointers == 0 and ctype.base in header.structs:
                why = _struct_problems(header, ctype.base, given._type_)
            else:
                why = _disagreement(header, pointee, given._type_)
            return f"{_name(given)}, whose pointee: {why}" if why else ""
        return f"{_describe(given)}, not a pointer"
    if ctype.base in header.structs:
        return f"{_describe(given)}: a struct passed by value is outside cbgen.h's subset"
    want = _C_TYPES[ctype.base]
    return "" if _kind(given) == _kind(want) else _describe(given)


def _kind(t: CTypesType) -> tuple[object, ...]:
    """What passing a value of scalar ctypes type t means to the callee: (code class, size)."""
    if t is None:
        return ("void",)
    code = getattr(t, "_type_", None)
    if isinstance(code, str) and code in _INT_CODES:
        return ("int", ctypes.sizeof(t), code.islower())
    if isinstance(code, str) and code in "fdg":
        return ("float", ctypes.sizeof(t))
    return ("other", t)


def _describe(t: CTypesType) -> str:
    kind = _kind(t)
    if kind[0] == "int":
        return f"{_name(t)}, a {kind[1]}-byte {'signed' if kind[2] else 'unsigned'} integer"
    if kind[0] == "float":
        return f"{_name(t)}, a {kind[1]}-byte float"
    return _name(t)


def _name(t: CTypesType) -> str:
    return "None (void)" if t is None else getattr(t, "__name__", repr(t))


def _signature_text(proto: Prototype) -> str:
    args = ", ".join(f"{t} {a}".strip() for t, a in proto.args) or "void"
    return f"{proto.restype} {proto.name}({args})"
