"""Speculation-strategy registration records and their marshalling (tick ABI §2, rules 114-122).

These records have no Link W form (registration happens in the worker at bundle load), so they
live here rather than in ``basertd.schema.tick``. ``None`` for a string field is sent as a NULL
pointer on purpose: the ABI says such a registration is refused (rule 116), and conformance tests
need to send it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import cffi
import numpy as np

from basertd.native._errors import ArgumentError
from basertd.native._events import ArrayReader
from basertd.schema.tick import StateSpaceDesc

_ZERO32 = bytes(32)


@dataclass(frozen=True)
class Artifact:
    """A file a strategy loads (BaseRTArtifact, 56 bytes). ``content_hash`` is 32 bytes;
    ``byte_size`` in bytes; ``load_path`` None sends NULL."""

    role: int
    load_path: str | None
    content_hash: bytes = _ZERO32
    byte_size: int = 0


@dataclass(frozen=True)
class TapSpec:
    """A tensor the strategy reads from the model (BaseRTTapSpec, 16 bytes)."""

    layer: int
    tensor: int
    dtype: int = 0
    layout: int = 0


@dataclass(frozen=True)
class CapabilityReq:
    """A typed capability (BaseRTCapabilityReq, 24 bytes): ``kind_id`` (StrategyCap or newer)
    and ``params``, the raw bytes of ``len(params) // param_elem_size`` kind-defined records."""

    kind_id: int
    params: bytes = b""
    param_elem_size: int = 0


@dataclass(frozen=True)
class StrategyRegistration:
    """BaseRTStrategyRegistration (176 bytes). Hashes are 32 bytes; ``est_state_bytes`` in
    bytes; ``target_archs`` empty means any architecture."""

    strategy_id: str | None
    impl_version: str | None = "0.0.0"
    impl_hash: bytes = _ZERO32
    config_hash: bytes = _ZERO32
    artifacts: Sequence[Artifact] = ()
    taps: Sequence[TapSpec] = ()
    capabilities: Sequence[CapabilityReq] = ()
    target_archs: Sequence[str | None] = ()
    kernel_caps_required: int = 0
    est_state_bytes: int = 0
    claimed_exactness: int = 0
    rng_contract_version: int = 0


@dataclass(frozen=True)
class ExactnessCert:
    """A certificate the engine granted (BaseRTExactnessCert, 32 bytes)."""

    cert_id: int
    exactness: int
    sampling_modes: int
    grammar_allowed: int
    logit_bias_allowed: int
    param_domain: int
    verification_shape_class: int
    admissible_host_identities: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class StrategyGrant:
    """What registration granted (BaseRTStrategyGrant, 56 bytes): the slot admits name,
    certificates (empty unless certified, rule 117), drafter state spaces, and the bytes the
    budget ledger was charged (rule 118)."""

    strategy_slot: int
    certificates: list[ExactnessCert] = field(default_factory=list)
    state_spaces: list[StateSpaceDesc] = field(default_factory=list)
    reserved_bytes: int = 0


def _hash(value: bytes, what: str) -> bytes:
    if len(value) != 32:
        raise ArgumentError(f"{what} must be 32 bytes, got {len(value)}")
    return value


class RegistrationMarshal:
    """Builds a ``BaseRTStrategyRegistration *`` whose memory (strings, arrays) is held in
    ``self.keep`` until this object is dropped, i.e. for the duration of the call."""

    def __init__(self, ffi: cffi.FFI) -> None:
        self.ffi = ffi
        self.keep: list[object] = []

    def _str(self, s: str | None):
        if s is None:
            return self.ffi.NULL
        b = s.encode()
        if b"\0" in b:
            raise ArgumentError(f"string {s!r} contains a NUL byte")
        c = self.ffi.new("char[]", b)
        self.keep.append(c)
        return c

    def _array(self, ctype: str, items: list[dict]) -> dict:
        if not items:
            return {"data": self.ffi.NULL, "count": 0, "elem_size": self.ffi.sizeof(ctype)}
        arr = self.ffi.new(f"{ctype}[]", items)
        self.keep.append(arr)
        return {"data": arr, "count": len(items), "elem_size": self.ffi.sizeof(ctype)}

    def build(self, reg: StrategyRegistration):
        """The C registration for ``reg``. Raises ``ArgumentError`` for a hash that is not 32
        bytes, a string with a NUL, params not a whole number of records, or a value out of its
        C range."""
        ffi = self.ffi
        caps = []
        for c in reg.capabilities:
            if c.params:
                if c.param_elem_size <= 0 or len(c.params) % c.param_elem_size:
                    raise ArgumentError(f"capability {c.kind_id}: params are not whole records")
                buf = ffi.new("uint64_t[]", (len(c.params) + 7) // 8)
                ffi.memmove(buf, c.params, len(c.params))
                self.keep.append(buf)
                params = {
                    "data": buf,
                    "count": len(c.params) // c.param_elem_size,
                    "elem_size": c.param_elem_size,
                }
            else:
                params = {"data": ffi.NULL, "count": 0, "elem_size": c.param_elem_size}
            caps.append({"kind_id": c.kind_id, "params": params})
        archs = [self._str(a) for a in reg.target_archs]
        if archs:
            arch_arr = ffi.new("const char *[]", archs)
            self.keep.append(arch_arr)
            target = {"data": arch_arr, "count": len(archs), "elem_size": ffi.sizeof("char *")}
        else:
            target = {"data": ffi.NULL, "count": 0, "elem_size": ffi.sizeof("char *")}
        try:
            c = ffi.new(
                "BaseRTStrategyRegistration *",
                {
                    "struct_size": ffi.sizeof("BaseRTStrategyRegistration"),
                    "strategy_id": self._str(reg.strategy_id),
                    "impl_version": self._str(reg.impl_version),
                    "impl_hash": _hash(reg.impl_hash, "impl_hash"),
                    "config_hash": _hash(reg.config_hash, "config_hash"),
                    "artifacts": self._array(
                        "BaseRTArtifact",
                        [
                            {
                                "role": a.role,
                                "content_hash": _hash(a.content_hash, "artifact content_hash"),
                                "byte_size": a.byte_size,
                                "load_path": self._str(a.load_path),
                            }
                            for a in reg.artifacts
                        ],
                    ),
                    "taps": self._array(
                        "BaseRTTapSpec",
                        [
                            {"layer": t.layer, "tensor": t.tensor, "dtype": t.dtype, "layout": t.layout}
                            for t in reg.taps
                        ],
                    ),
                    "capabilities": self._array("BaseRTCapabilityReq", caps),
                    "target_archs": target,
                    "kernel_caps_required": reg.kernel_caps_required,
                    "est_state_bytes": reg.est_state_bytes,
                    "claimed_exactness": reg.claimed_exactness,
                    "rng_contract_version": reg.rng_contract_version,
                },
            )
        except (OverflowError, TypeError, ValueError) as e:
            raise ArgumentError(f"strategy registration: {e}") from e
        self.keep.append(c)
        return c


def read_grant(reader: ArrayReader, address: int) -> StrategyGrant:
    """Decode the engine-owned ``BaseRTStrategyGrant`` at ``address`` by the section-C rules
    (raises ``EventsMalformed``)."""
    _, slot, certs, spaces, reserved = reader.struct_at(address, "BaseRTStrategyGrant", "grant")
    out = []
    rows = reader.array(certs, "BaseRTExactnessCert", "grant.certificates").tolist()
    for i, (cert_id, exactness, modes, grammar, bias, domain, shape, ids) in enumerate(rows):
        idents = reader.records(
            *ids, np.dtype("V32"), 32, f"grant.certificates[{i}].admissible_host_identities"
        )
        out.append(
            ExactnessCert(
                cert_id=cert_id,
                exactness=exactness,
                sampling_modes=modes,
                grammar_allowed=grammar,
                logit_bias_allowed=bias,
                param_domain=domain,
                verification_shape_class=shape,
                admissible_host_identities=tuple(idents.tolist()),
            )
        )
    return StrategyGrant(
        strategy_slot=slot,
        certificates=out,
        state_spaces=reader.state_spaces(spaces, "grant.state_spaces"),
        reserved_bytes=reserved,
    )
