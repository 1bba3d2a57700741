"""The cffi declarations in specfast/_cdef.py match csrc/include/specfast.h."""

import os
import pathlib
import shutil
import subprocess

import pytest
import pycparser
from pycparser import c_ast, c_generator

from specfast._cdef import CDEF
from specfast._lib import ffi

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = ROOT / "csrc" / "include" / "specfast.h"
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler to preprocess the header")

STDINT = "typedef int int32_t; typedef long long int64_t; typedef unsigned int uint32_t; " \
         "typedef unsigned long long uint64_t; typedef unsigned short uint16_t; " \
         "typedef unsigned char uint8_t;\n"


def _declarations(source):
    """Name -> normalised C text of every typedef and function declaration."""
    ast = pycparser.CParser().parse(STDINT + source)
    gen = c_generator.CGenerator()
    out = {}
    for node in ast.ext:
        if isinstance(node, c_ast.Typedef) and node.name.endswith("_t"):
            continue
        text = " ".join(gen.visit(node).split())
        out[node.name] = text
    return out


def _preprocessed_header():
    res = subprocess.run(
        [CC, "-E", "-P", "-D__attribute__(x)=", "-U__GNUC__", "-DSF_API=", str(HEADER)],
        check=True, capture_output=True, text=True,
    )
    # Keep what follows the system headers' typedefs.
    return res.stdout[res.stdout.index("typedef enum sf_status"):]


def test_cdef_declares_what_the_header_declares():
    header = _declarations(_preprocessed_header())
    cdef = _declarations(CDEF)
    assert set(cdef) == set(header)
    for name in header:
        assert cdef[name] == header[name], name


def test_struct_layout_matches_the_compiled_header(tmp_path):
    structs = ["sf_logits", "sf_params", "sf_draft", "sf_verify_out", "sf_error", "sf_kv_cache"]
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "specfast.h"', "int main(void) {"]
    expect = []
    for s in structs:
        lines.append(f'printf("%zu\\n", sizeof({s}));')
        expect.append(ffi.sizeof(s))
        for field, _ in ffi.typeof(s).fields:
            lines.append(f'printf("%zu\\n", offsetof({s}, {field}));')
            expect.append(ffi.offsetof(s, field))
    for const in ["SF_ERR_UNSUPPORTED", "SF_BF16", "SF_COUPLED", "SF_DRAFT_SPARSE"]:
        lines.append(f'printf("%d\\n", (int){const});')
        expect.append(_enum(const))
    lines += ["return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run([CC, f"-I{HEADER.parent}", str(src), "-o", str(exe)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True,
                                          text=True).stdout.split()]
    assert got == expect


def _enum(name):
    for t in ["sf_status", "sf_dtype", "sf_method", "sf_draft_kind"]:
        values = ffi.typeof(t).relements
        if name in values:
            return values[name]
    raise KeyError(name)
