"""A shared library's dynamic table (NEEDED entries, dynamic symbols) read from its ELF64 file, and the C++
runtime check over it (docs/build.md, "The C++ runtime").

A library with C++ code must take the C++ runtime from libstdc++.so.6. One that links libstdc++.a into
itself and exports it (what `-static-libstdc++`, or a link that finds libstdc++.a before libstdc++.so, gives)
offers a second copy of std::, and a library loaded after it can bind to that copy and crash in it.

This module imports nothing of edgemoe: the build tools load it by file path before edgemoe is installed."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

CXX_RUNTIME_SONAME = "libstdc++.so.6"

_SHT_DYNAMIC = 6
_SHT_DYNSYM = 11
_DT_NULL, _DT_NEEDED, _DT_SONAME = 0, 1, 14
_STB_GLOBAL, _STB_WEAK, _STB_GNU_UNIQUE = 1, 2, 10
_STV_HIDDEN, _STV_INTERNAL = 2, 1

# Only the C++ runtime (libstdc++ / libsupc++) defines these: a library that exports one carries a copy.
# A normal C++ library exports std:: template instantiations of its own (libllama ~1,000), never these.
RUNTIME_MARKERS = frozenset(
    {
        "__gxx_personality_v0",  # the exception personality routine
        "_ZSt9terminatev",  # std::terminate()
        "_ZNSt6locale7classicEv",  # std::locale::classic()
        "_ZNSt8ios_base4InitC1Ev",  # std::ios_base::Init::Init()
        "_ZNSo9_M_insertIlEERSoT_",  # std::ostream::_M_insert<long> (the device's crash went through it)
    }
)
RUNTIME_PREFIXES = (
    "__cxa_",  # the C++ ABI's functions (__cxa_throw, __cxa_allocate_exception, __cxa_guard_acquire, ...)
    "_ZTVN10__cxxabiv1",  # the ABI's type_info vtables
)
# the C library's: every shared object gcc links references __cxa_finalize, C or C++
_LIBC_CXA = frozenset({"__cxa_finalize", "__cxa_atexit", "__cxa_thread_atexit_impl"})
# mangled names in namespace std:: (std::ostream and std::istream have abbreviations of their own)
_STD_PREFIXES = tuple("_ZNSt _ZNKSt _ZSt _ZTVSt _ZTISt _ZTSSt _ZNSo _ZNSi _ZNKSo _ZNKSi".split())
# a name that only C++ code references or defines: the runtime's ABI, operator new/delete and std::
_CXX_PREFIXES = (
    *"__cxa_ __gxx_personality _ZTVN10__cxxabiv1 _Znwm _Znam _ZdlPv _ZdaPv".split(),
    *_STD_PREFIXES,
)


class ElfError(ValueError):
    """A file that is not an ELF64 shared object this reader understands."""


class Symbol(NamedTuple):  # a NamedTuple: built thousands of times per library, a dataclass is 3x slower
    name: str
    defined: bool  # st_shndx != SHN_UNDEF
    binding: int  # STB_*: 1 global, 2 weak, 10 unique
    exported: bool  # defined, global/weak/unique binding, default or protected visibility


@dataclass(frozen=True)
class DynamicTable:
    path: Path
    soname: str | None
    needed: tuple[str, ...]  # DT_NEEDED, in order
    symbols: tuple[Symbol, ...]  # .dynsym without its null entry


@dataclass(frozen=True)
class _Section:
    type: int
    offset: int
    size: int
    link: int
    entsize: int


def _read_at(f: BinaryIO, offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise ElfError(f"{f.name}: truncated ({size} bytes wanted at offset {offset})")
    return data


def _string(table: bytes, offset: int) -> str:
    end = table.find(b"\0", offset)
    return table[offset : end if end >= 0 else len(table)].decode("utf-8", errors="replace")


def read_dynamic(path: str | os.PathLike[str], *, only: tuple[bytes, ...] | None = None) -> DynamicTable:
    """The NEEDED entries, soname and dynamic symbols of an ELF64 file; reads only the headers and the
    dynamic sections (a CUDA library is hundreds of MB, mostly device code). only: keep just the symbols whose
    name starts with one of these (decoding every name is most of the time on libllama's 6,000)."""
    path = Path(path)
    with path.open("rb") as f:
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF":
            raise ElfError(f"{path} is not an ELF file")
        if ident[4] != 2 or ident[5] not in (1, 2):
            raise ElfError(f"{path} is not a 64-bit ELF file (class {ident[4]}, data {ident[5]})")
        end = "<" if ident[5] == 1 else ">"
        shoff, shentsize, shnum = (
            struct.unpack_from(end + "Q", ident, 40)[0],
            *struct.unpack_from(end + "HH", ident, 58),
        )
        if shoff == 0:
            raise ElfError(f"{path} has no section headers")
        if shnum == 0:  # extended numbering: the count is in section 0's sh_size
            shnum = struct.unpack_from(end + "Q", _read_at(f, shoff, shentsize), 32)[0]
        raw = _read_at(f, shoff, shentsize * shnum)
        sections = [
            _Section(s[1], s[4], s[5], s[6], s[9])
            for s in (struct.unpack_from(end + "IIQQQQIIQQ", raw, i * shentsize) for i in range(shnum))
        ]

        def contents(section: _Section) -> bytes:
            return _read_at(f, section.offset, section.size)

        def strtab(section: _Section) -> bytes:
            if not 0 < section.link < len(sections):
                raise ElfError(f"{path}: a dynamic section links no string table")
            return contents(sections[section.link])

        needed: list[str] = []
        soname: str | None = None
        for sec in (s for s in sections if s.type == _SHT_DYNAMIC):
            names = strtab(sec)
            for tag, val in struct.iter_unpack(end + "qQ", contents(sec)[: sec.size - sec.size % 16]):
                if tag == _DT_NULL:
                    break
                if tag == _DT_NEEDED:
                    needed.append(_string(names, val))
                elif tag == _DT_SONAME:
                    soname = _string(names, val)
        symbols: list[Symbol] = []
        for sec in (s for s in sections if s.type == _SHT_DYNSYM):
            names = strtab(sec)
            data = contents(sec)[24:]  # entry 0 is the null symbol
            for st_name, info, other, shndx, _value, _size in struct.iter_unpack(
                end + "IBBHQQ", data[: len(data) - len(data) % 24]
            ):
                if only is not None and not names.startswith(only, st_name):
                    continue
                binding, visibility = info >> 4, other & 3
                defined = shndx != 0
                exported = (
                    defined
                    and binding in (_STB_GLOBAL, _STB_WEAK, _STB_GNU_UNIQUE)
                    and visibility not in (_STV_HIDDEN, _STV_INTERNAL)
                )
                symbols.append(Symbol(_string(names, st_name), defined, binding, exported))
    return DynamicTable(path, soname, tuple(needed), tuple(symbols))


def has_cxx_code(table: DynamicTable) -> bool:
    """Whether the library references or defines the C++ runtime's ABI or std:: names."""
    return any(s.name.startswith(_CXX_PREFIXES) and s.name not in _LIBC_CXA for s in table.symbols)


def runtime_definitions(table: DynamicTable) -> tuple[str, ...]:
    """The C++ runtime's own symbols (RUNTIME_MARKERS, RUNTIME_PREFIXES) the library defines and exports."""
    return tuple(
        s.name
        for s in table.symbols
        if s.exported
        and (s.name in RUNTIME_MARKERS or s.name.startswith(RUNTIME_PREFIXES))
        and s.name not in _LIBC_CXA
    )


RUNTIME_NAME_PREFIXES = tuple(n.encode() for n in sorted(RUNTIME_MARKERS) + list(RUNTIME_PREFIXES))


def exported_runtime(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """runtime_definitions of the library at path, reading only the names that can match (the loader's guard)."""
    return runtime_definitions(read_dynamic(path, only=RUNTIME_NAME_PREFIXES))


def cxx_runtime_problems(table: DynamicTable) -> list[str]:
    """What is wrong with the library's C++ runtime, one line each; [] for a library without C++ code or
    one that takes the runtime from libstdc++.so.6 alone."""
    if not has_cxx_code(table):
        return []
    name = table.path.name
    problems: list[str] = []
    copies = runtime_definitions(table)
    if copies:
        n_std = sum(1 for s in table.symbols if s.exported and s.name.startswith(_STD_PREFIXES))
        problems.append(
            f"{name} defines and exports the C++ runtime itself ({', '.join(sorted(copies)[:3])}, "
            f"{len(copies)} runtime symbols, {n_std} exported std:: symbols): a library loaded after it "
            f"binds to this copy instead of {CXX_RUNTIME_SONAME} and can crash in it"
        )
    if CXX_RUNTIME_SONAME not in table.needed:
        problems.append(
            f"{name} has C++ code but does not link {CXX_RUNTIME_SONAME} (NEEDED: "
            f"{', '.join(table.needed) or 'none'}): libstdc++ was linked into it statically"
        )
    if problems:
        problems.append(
            f"  to fix {name}: relink it against the shared libstdc++.so: drop -static-libstdc++, and make sure "
            "no -L directory on its link line holds libstdc++.a without libstdc++.so (the build log's C++ runtime "
            "lines list them); docs/build.md, 'The C++ runtime'"
        )
    return problems


def library_files(directory: str | os.PathLike[str]) -> list[Path]:
    """One file per shared library in directory: lib*.so* by library name (pip installs libggml.so, .so.0 and
    .so.0.25.3 as copies, CMake as symlinks), the soname's file (libX.so.N) first, else the shortest name."""
    by_name: dict[str, list[Path]] = {}
    for p in Path(directory).glob("lib*.so*"):
        if p.is_file():
            by_name.setdefault(p.name.split(".so", 1)[0], []).append(p)

    def rank(p: Path) -> tuple[int, int, str]:
        suffix = p.name.split(".so", 1)[1]
        return (0 if suffix.count(".") == 1 else 1, len(p.name), p.name)

    return [min(paths, key=rank) for _, paths in sorted(by_name.items())]


def check_libraries(paths: list[Path]) -> list[str]:
    """cxx_runtime_problems over each library, in order; a file that is not ELF64 is a problem of its own."""
    problems: list[str] = []
    for p in paths:
        try:
            problems.extend(cxx_runtime_problems(read_dynamic(p)))
        except (ElfError, OSError) as err:
            problems.append(f"{p.name} could not be read as a shared library: {err}")
    return problems
