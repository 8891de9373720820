"""RULES.md section A (rules 1-12): struct layout, checked three ways.

A C probe, generated from the cffi-parsed declarations so no struct or field is forgotten, is
compiled with the system compiler against native/basert_tick.h and prints sizeof, alignof and
every field's offset and size, plus every integer constant. Its numbers are compared with the
sizes RULES.md states, with cffi's view of the same declarations (what the binding uses), and
field by field for explicit padding (each field starts where the previous one ended).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from basertd.native import header_path
from basertd.native._layout import struct_names
from basertd.native.abi import TICK_FUNCTIONS

ROOT = Path(__file__).resolve().parents[2]
SEED_HEADER = ROOT.parent / "shared" / "reference" / "seeds" / "baseRT_tick.h.txt"
CC = shutil.which("cc") or shutil.which("gcc")
CXX = shutil.which("c++") or shutil.which("g++")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler on PATH: the layout probe cannot be built")

# Sizes and offsets exactly as RULES.md section A states them: rule -> {struct: (size, {field: offset})}.
RULE_LAYOUT: dict[int, dict[str, tuple[int, dict[str, int]]]] = {
    1: {"BaseRTArray": (16, {"count": 8, "elem_size": 12})},
    2: {"BaseRTTokenRef": (24, {"generation": 16}), "BaseRTRingRef": (16, {})},
    3: {"BaseRTSamplingParams": (32, {"flags": 28}), "BaseRTShedPolicy": (40, {})},
    4: {
        "BaseRTLaneAdmit": (144, {"host_sampler_identity": 104, "grammar_replay": 136, "decode_replay": 140})
    },
    5: {
        "BaseRTLaneCommit": (24, {}),
        "BaseRTLanePrefill": (16, {}),
        "BaseRTLaneDecode": (16, {"overshoot": 10}),
        "BaseRTLaneRetire": (16, {}),
    },
    6: {"BaseRTTickPlan": (168, {"on_partial_emit": 152, "partial_emit_user": 160})},
    7: {
        "BaseRTAdmitResult": (24, {}),
        "BaseRTSpecStats": (16, {}),
        "BaseRTLaneEmit": (72, {"logits_row": 40, "spec": 56}),
        "BaseRTLaneFault": (24, {}),
        "BaseRTShedEntry": (32, {}),
        "BaseRTShedReport": (32, {}),
        "BaseRTOpComplete": (24, {}),
    },
    8: {
        "BaseRTTickTimings": (32, {}),
        "BaseRTMemCounters": (48, {}),
        "BaseRTLaneLogprob": (176, {}),
        "BaseRTTickEvents": (216, {"logprobs": 200}),
    },
    9: {
        "BaseRTRingDesc": (48, {}),
        "BaseRTStateSpaceDesc": (96, {}),
        "BaseRTArtifact": (56, {}),
        "BaseRTTapSpec": (16, {}),
        "BaseRTCapabilityReq": (24, {}),
        "BaseRTStrategyRegistration": (176, {}),
        "BaseRTExactnessCert": (32, {}),
        "BaseRTStrategyGrant": (56, {}),
    },
    10: {
        "BaseRTOpStatus": (24, {}),
        "BaseRTMatchCandidate": (48, {}),
        "BaseRTSpaceMatch": (24, {}),
        "BaseRTMatchResult": (24, {}),
        "BaseRTStateEnvelope": (136, {}),
        "BaseRTCacheKey": (64, {}),
        "BaseRTMediaInfo": (24, {}),
        "BaseRTBuf": (16, {}),
        "BaseRTTokenRange": (16, {}),
    },
}


def _constant_names(ffi) -> list[str]:
    lib = ffi.dlopen(None)  # constants come from the declarations; no symbol is resolved
    return sorted(n for n in dir(lib) if n.startswith("BASERT_"))


def _probe_source(ffi, header_include: str) -> str:
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        f'#include "{header_include}"',
        "#define MEMBER_SIZE(T, f) sizeof(((T *)0)->f)",
        "int main(void) {",
    ]
    for name in struct_names(ffi):
        lines.append(f'  printf("S {name} %zu %zu\\n", sizeof({name}), _Alignof({name}));')
        for field, _ in ffi.typeof(name).fields:
            where = f"offsetof({name}, {field}), MEMBER_SIZE({name}, {field})"
            lines.append(f'  printf("F {name} {field} %zu %zu\\n", {where});')
    for const in _constant_names(ffi):
        lines.append(f'  printf("C {const} %lld\\n", (long long)({const}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def _run_probe(ffi, tmp: Path, header: Path) -> dict:
    src = tmp / "probe.c"
    src.write_text(_probe_source(ffi, header.name))
    exe = tmp / "probe"
    flags = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-Wpadded", f"-I{header.parent}"]
    subprocess.run([CC, *flags, str(src), "-o", str(exe)], check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    structs: dict[str, tuple[int, int]] = {}
    fields: dict[str, list[tuple[str, int, int]]] = {}
    consts: dict[str, int] = {}
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "S":
            structs[rest[0]] = (int(rest[1]), int(rest[2]))
        elif kind == "F":
            fields.setdefault(rest[0], []).append((rest[1], int(rest[2]), int(rest[3])))
        else:
            consts[rest[0]] = int(rest[1])
    return {"structs": structs, "fields": fields, "consts": consts}


@pytest.fixture(scope="module")
def probe(tick_ffi, tmp_path_factory) -> dict:
    """sizeof/alignof/offsetof of every struct and field and every constant, as C sees them."""
    if CC is None:
        pytest.skip("no C compiler on PATH: the layout probe cannot be built")
    return _run_probe(tick_ffi, tmp_path_factory.mktemp("probe"), Path(header_path()))


def _offsets(probe: dict, struct_name: str) -> dict[str, int]:
    return {f: off for f, off, _ in probe["fields"][struct_name]}


@pytest.mark.parametrize("rule", sorted(RULE_LAYOUT))
def test_rule_sizes_and_offsets(rule, probe, tick_ffi):
    # ABI rules 1-10: each struct's size and named field offsets, in C and in cffi.
    for name, (size, offs) in RULE_LAYOUT[rule].items():
        assert probe["structs"][name][0] == size, f"rule {rule}: C sizeof({name})"
        assert tick_ffi.sizeof(name) == size, f"rule {rule}: cffi sizeof({name})"
        c_offs = _offsets(probe, name)
        for field, off in offs.items():
            assert c_offs[field] == off, f"rule {rule}: C offsetof({name}, {field})"
            assert tick_ffi.offsetof(name, field) == off, f"rule {rule}: cffi offsetof({name}, {field})"


def test_rule_6_legacy_prefix_is_152(probe):
    # ABI rule 6: the legacy plan prefix (everything before the partial-emit tail) is 152 bytes.
    tail = _offsets(probe, "BaseRTTickPlan")["on_partial_emit"]
    shed = _offsets(probe, "BaseRTTickPlan")["shed_policy"]
    assert tail == 152
    assert shed + probe["structs"]["BaseRTShedPolicy"][0] == 152


def test_rule_4_admit_v1_prefix_is_136(probe):
    # ABI rules 4 and 18: the admit's v1 prefix ends where grammar_replay starts.
    admit = {f: (off, size) for f, off, size in probe["fields"]["BaseRTLaneAdmit"]}
    off, size = admit["host_sampler_identity"]
    assert (off, size) == (104, 32)
    assert off + size == 136 == admit["grammar_replay"][0]


def test_every_header_struct_has_a_size_rule(tick_ffi):
    # ABI rules 1-10 together cover every struct of the header; a new struct needs a rule.
    listed = {name for structs in RULE_LAYOUT.values() for name in structs}
    assert set(struct_names(tick_ffi)) == listed


def test_rule_11_c_and_cffi_agree_on_every_field(probe, tick_ffi):
    # ABI rule 11: same size and field offsets in C and in the Python binding.
    names = struct_names(tick_ffi)
    assert set(probe["structs"]) == set(names)
    for name in names:
        ctype = tick_ffi.typeof(name)
        assert probe["structs"][name] == (tick_ffi.sizeof(ctype), tick_ffi.alignof(ctype)), name
        cffi_fields = [(f, fld.offset, tick_ffi.sizeof(fld.type)) for f, fld in ctype.fields]
        assert probe["fields"][name] == cffi_fields, name


def test_rule_11_alignment_at_most_8(probe):
    # ABI rule 11: every ABI struct has alignment <= 8.
    for name, (_, align) in probe["structs"].items():
        assert align <= 8, f"{name} is {align}-byte aligned"


def test_rule_11_no_implicit_padding(probe):
    # ABI rule 11 / layout discipline: each field starts where the previous one ended and the
    # struct ends where its last field ends (all padding is an explicit _pad field).
    for name, fields in probe["fields"].items():
        end = 0
        for field, off, size in sorted(fields, key=lambda f: f[1]):
            assert off == end, f"{name}.{field} at {off}: {off - end} implicit padding bytes before it"
            end = off + size
        assert end == probe["structs"][name][0], (
            f"{name}: {probe['structs'][name][0] - end} bytes of tail padding"
        )


def test_rule_12_constants(probe, tick_ffi):
    # ABI rule 12: MAX_TOP_LOGPROBS = 20, ALL_SPACES = 0xFFFFFFFF, envelope magic reads "BRTSTATE".
    lib = tick_ffi.dlopen(None)
    for source in (probe["consts"], {n: getattr(lib, n) for n in _constant_names(tick_ffi)}):
        assert source["BASERT_MAX_TOP_LOGPROBS"] == 20
        assert source["BASERT_ALL_SPACES"] == 0xFFFFFFFF
        assert struct.pack("<Q", source["BASERT_STATE_ENVELOPE_MAGIC"]) == b"BRTSTATE"
        # Rule 123's ring magic is the other way round: its LE bytes are 31 47 4E 49 52 54 52 42
        # ("1GNIRTRB"); the u64 reads "BRTRING1" only when written most significant byte first.
        assert struct.pack("<Q", source["BASERT_RING_MAGIC"]) == bytes.fromhex("31474E4952545242")
        assert struct.pack(">Q", source["BASERT_RING_MAGIC"]) == b"BRTRING1"
    assert tick_ffi.typeof("BaseRTLaneLogprob").fields[3][1].type.length == 20


def test_rule_11_c_and_cffi_agree_on_every_constant(probe, tick_ffi):
    # ABI rule 11 (constants half): the binding reads the same value of every constant as C.
    lib = tick_ffi.dlopen(None)
    assert probe["consts"] == {n: getattr(lib, n) for n in _constant_names(tick_ffi)}
    assert len(probe["consts"]) >= 120


@needs_cc
@pytest.mark.parametrize("lang", ["c11", "c++11"])
def test_header_compiles_strictly(lang, tmp_path):
    # ABI rule 11: the header compiles as C and as C++ with -Wpadded -Werror (no implicit padding
    # anywhere) and its static asserts of the section-A sizes hold under both.
    compiler = CC if lang == "c11" else CXX
    if compiler is None:
        pytest.skip(f"no compiler for {lang}")
    src = tmp_path / ("t.c" if lang == "c11" else "t.cpp")
    src.write_text('#include "basert_tick.h"\nint main(void) { return (int)sizeof(BaseRTTickPlan) - 168; }\n')
    flags = [f"-std={lang}", "-Wall", "-Wextra", "-Wpedantic", "-Wpadded", "-Werror"]
    exe = tmp_path / "t"
    res = subprocess.run(
        [compiler, *flags, f"-I{Path(header_path()).parent}", str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert subprocess.run([str(exe)]).returncode == 0


@needs_cc
def test_static_asserts_catch_a_wrong_size(tmp_path):
    # ABI rules 1-10: the header's static asserts are live: a header whose struct grew by a field
    # must fail to compile.
    text = Path(header_path()).read_text()
    broken = text.replace(
        "    uint32_t elem_size;\n} BaseRTArray;",
        "    uint32_t elem_size;\n    uint64_t extra;\n} BaseRTArray;",
    )
    assert broken != text
    (tmp_path / "basert_tick.h").write_text(broken)
    src = tmp_path / "t.c"
    src.write_text('#include "basert_tick.h"\nint main(void) { return 0; }\n')
    res = subprocess.run(
        [CC, "-std=c11", f"-I{tmp_path}", "-c", str(src), "-o", str(tmp_path / "t.o")],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0
    assert "BaseRTArray" in res.stderr


@needs_cc
@pytest.mark.skipif(
    not SEED_HEADER.is_file(), reason="reference seed header not present next to this checkout"
)
def test_layout_matches_reference_header(probe, tick_ffi, tmp_path):
    # ABI rules 1-12: the same probe compiled against the reference header of the ABI prints the
    # same structs, fields (names, offsets, sizes) and constants as against ours.
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    (ref_dir / "baseRT_tick.h").write_text(SEED_HEADER.read_text())
    ref = _run_probe(tick_ffi, ref_dir, ref_dir / "baseRT_tick.h")
    assert ref == probe


def test_library_exports_every_function(abi_lib):
    # ABI rule 11 (binding side): the library under test exports all 34 functions the header
    # declares, so every binding wrapper resolves (BasertLib refuses a library lacking any).
    assert len(TICK_FUNCTIONS) == 34
    for name in TICK_FUNCTIONS:
        assert callable(getattr(abi_lib.lib, name)), name
