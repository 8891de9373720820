"""The C reference engine's test surface (``native/ref_engine/basert_ref.h``) in Python.

``create_ref_bundle(RefConfig(...))`` opens ``libbasert_ref.so`` through ``basertd.native.abi``
(``BasertLib`` with the ``baseRT_ref_*`` declarations added), creates a bundle with
``baseRT_ref_create_checked`` and returns a ``RefBundle``: an ``abi.Bundle`` - every tick-ABI call
goes through exactly the binding a real libbaseRT uses - plus the reference-only calls
``force_finish``, ``inject_fault``, ``refuse_admits``, ``stats`` and ``lane_info``.
``close()`` frees the bundle with ``baseRT_ref_free``. For state ops and strategies it adds
``space_info`` (a sequence's per-space state), ``set_export_checksum`` (FNV-1a-64 or XXH3-64 in
exports), ``certify`` (certified strategy combinations, ABI rule 117) and ``media_tower`` (a
synthetic vision tower for the media calls).

What the engine does (plan validation, tick order, synthetic tokens, pool, cache, seeds, HOST
lanes, replay) is documented in the header comment of ``basert_ref.h``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from basertd.native import ref_engine_path
from basertd.native._cdef import header_to_cdef
from basertd.native._strategy import ExactnessCert
from basertd.native.abi import ArgumentError, BasertLib, Bundle, error_for
from basertd.schema.abi import CertDomain, Exactness, SpaceKind

REF_HEADER = Path(__file__).resolve().parent / "ref_engine" / "basert_ref.h"
"""The test-surface header (installed as package data next to the engine sources)."""


class RefuseKind:
    """Predicates of ``RefBundle.refuse_admits`` (BASERT_REF_REFUSE_*)."""

    NONE = 0
    TAG_MASK = 1  # lane_tag & param != 0
    TAG_EQUALS = 2  # lane_tag == param
    ALL = 3
    PROMPT_OVER = 4  # prompt longer than param tokens


class LaneState:
    """``LaneInfo.state`` values (BASERT_REF_LANE_*)."""

    LIVE = 0
    FINISHED = 1
    FAULTED = 2


@dataclass(frozen=True)
class RefSpace:
    """One state space of a reference bundle (BaseRTRefSpace). At most one paged space (its page
    size and bytes per token are the bundle's); blob kinds record a snapshot boundary every
    ``snapshot_interval_tokens`` tokens (cadence 2) or at the published end (cadence 1)."""

    space_id: int
    kind: int = SpaceKind.PAGED_TOKEN_KV
    flags: int = 0  # SpaceFlag bits
    blob_bytes: int = 0  # bytes of one blob snapshot
    version_tag: int = 1
    snapshot_cadence: int = 0  # 0 none, 1 tool boundary, 2 interval
    snapshot_interval_tokens: int = 0
    name: str = ""


@dataclass(frozen=True)
class RefConfig:
    """Configuration of a reference bundle (BaseRTRefConfig); the defaults make a working bundle.

    Sizes in tokens unless named ``_bytes``; ``tick_delay_us`` in microseconds (a real sleep per
    accepted tick, the decode step); ``prefill_step_tokens`` / ``prefill_step_us``: prefill runs in
    steps of that many tokens (0: one step), each followed by that real sleep, and a tick may end
    early between steps when a yield word is attached (``RefBundle.set_yield_word``);
    ``seed_lease_ticks`` in ticks (ABI rule 84). ``eos_period`` p > 0 makes the
    synthetic model draw ``eos_token`` about once per p tokens (0: never). ``scripted_tokens`` are
    emitted in order by every request (index counts its decode_replay tokens) before hashing takes
    over. ``spaces`` empty means one PAGED_TOKEN_KV space, id 0, named "kv"."""

    vocab_size: int = 512
    max_lanes: int = 16
    max_batch_size: int = 16
    page_size_tokens: int = 16
    bytes_per_token: int = 64
    pool_bytes: int = 1 << 20
    context_length: int = 1024
    eos_token: int = 2
    eos_period: int = 0
    tick_delay_us: int = 0
    seed_lease_ticks: int = 8
    scripted_tokens: Sequence[int] = ()
    spaces: Sequence[RefSpace] = ()
    identity: bytes = b""  # 32 bytes, or empty to derive it from the config
    kernel_caps: int = 0
    n_layers: int = 32
    arch: str = "ref-arch"
    prefill_step_tokens: int = 0
    prefill_step_us: int = 0


@dataclass(frozen=True)
class LaneInfo:
    """One lane as the reference engine holds it (BaseRTRefLaneInfo); tokens unless stated."""

    state: int  # LaneState
    finish: int  # Finish, once finished
    sampling: int
    prompt_len: int
    prefill_end: int  # prompt_len - decode_replay
    prefilled: int  # prompt tokens resident (seeded, prefilled or replayed)
    committed: int  # tokens resident in the lane's sequence
    generated: int  # tokens drawn or committed by the lane
    rng_counter: int  # counter of the next generated token (rng_counter_base + generated)
    row_nonce: int  # pending HOST row's generation, 0 when none
    taint_bits: int
    blocks: int  # pool blocks the lane's sequence references


@dataclass(frozen=True)
class SpaceInfo:
    """One (sequence, space) as the reference engine holds it (BaseRTRefSpaceInfo); tokens unless
    stated."""

    valid_len: int  # tokens of state the space holds
    content_gen: int  # sizing generation (ABI rule 96)
    seq_len: int  # tokens the sequence holds (its longest space)
    taint_bits: int  # Taint bits
    n_boundaries: int  # recorded snapshot boundaries (blob kinds)
    n_demoted: int  # ranges demoted and not promoted
    claimed: int  # 1 while a state op holds the pair (rule 98)
    ops_in_flight: int  # the sequence's claims + spaces with demoted ranges (rule 49)
    tokens_known: int  # 0 after a blob-only restore until seed_adopt names the tokens
    blocks: int  # pool blocks the sequence holds
    lane_owned: int
    leased: int  # held by a seed_adopt lease


def cert(
    exactness: int = Exactness.SEED_PATH_INVARIANT,
    sampling_modes: int = 0b111,
    param_domain: int = CertDomain.ANY,
    *,
    grammar_allowed: int = 0,
    logit_bias_allowed: int = 0,
    host_identities: Sequence[bytes] = (),
    verification_shape_class: int = 1,
) -> ExactnessCert:
    """A certificate template for ``RefBundle.certify`` (its cert_id is given by the engine at
    registration). ``sampling_modes`` are CertMode bits; identities are 32 bytes each."""
    return ExactnessCert(
        cert_id=0,
        exactness=exactness,
        sampling_modes=sampling_modes,
        grammar_allowed=grammar_allowed,
        logit_bias_allowed=logit_bias_allowed,
        param_domain=param_domain,
        verification_shape_class=verification_shape_class,
        admissible_host_identities=tuple(host_identities),
    )


STAT_FIELDS = (
    "ticks",
    "last_plan_seq",
    "prefill_tokens_total",
    "decode_tokens_total",
    "replay_tokens_total",
    "live_lanes",
    "live_seed_leases",
    "cache_entries",
    "cache_bytes",
    "pool_bytes_used",
    "pool_bytes_total",
    "pool_blocks_used",
    "pool_blocks_total",
    "evictions_total",
    "faults_total",
    "bare_sequences",
    "rejected_plans",
)
"""Keys of ``RefBundle.stats()`` (BaseRTRefStats without struct_size)."""


def ref_cdef() -> str:
    """cffi declarations of the ``baseRT_ref_*`` surface (basert_ref.h through native/_cdef.py)."""
    return header_to_cdef(REF_HEADER.read_text())


@functools.lru_cache(maxsize=4)
def open_ref_lib(path: str | None = None) -> BasertLib:
    """The reference engine opened through the tick-ABI binding with the test surface declared.
    ``path`` defaults to ``ref_engine_path()``; one ``BasertLib`` per path per process. Raises
    FileNotFoundError ("run make native") when the engine is not built, and the binding's
    LibraryError / MissingSymbols."""
    return BasertLib(path or ref_engine_path(), extra_cdef=ref_cdef())


class RefBundle(Bundle):
    """A reference-engine bundle: an ``abi.Bundle`` plus the reference-only test surface.

    Every method raises ``AbiError`` with the engine's ``Status`` on refusal (nothing changed)."""

    config: RefConfig

    def force_finish(self, lane_tag: int, finish: int) -> None:
        """End live lane ``lane_tag`` with ``finish`` (Finish.EOS..ERROR) in its next tick.
        AbiError(REJECT_UNKNOWN_LANE) unless live and unfinished; REJECT_BOUNDS for a bad code."""
        self._call("baseRT_ref_force_finish", self.handle, lane_tag, finish)

    def inject_fault(self, lane_tag: int, code: int) -> None:
        """Fault lane ``lane_tag`` with FaultCode ``code`` in its next tick (ABI rules 60-62)."""
        self._call("baseRT_ref_inject_fault", self.handle, lane_tag, code)

    def refuse_admits(self, kind: int, param: int = 0, status: int = 0) -> None:
        """Reject admits matching predicate ``kind`` (RefuseKind) / ``param`` in admit_results with
        reject_code ``status`` (a negative Status) from now on; RefuseKind.NONE stops it."""
        self._call("baseRT_ref_refuse_admits", self.handle, kind, param, status)

    def set_yield_word(self, address: int) -> None:
        """Attach the control segment's yield word at ``address`` (8-byte aligned; the yields-taken
        counter follows it) or detach with 0 (``basertd.shm.control``). The mapping must outlive the
        attachment. AbiError(REJECT_BAD_STRUCT) for a misaligned address."""
        ptr = self.ffi.cast("uint64_t *", address) if address else self.ffi.NULL
        self._call("baseRT_ref_set_yield_word", self.handle, ptr)

    def stats(self) -> dict[str, int]:
        """Counters and gauges (keys ``STAT_FIELDS``): ticks, tokens prefilled / decoded /
        replayed, lanes, leases, cache entries and bytes, pool bytes and blocks, evictions,
        faults, bare sequences, rejected plans."""
        out = self.ffi.new("BaseRTRefStats *", {"struct_size": self.ffi.sizeof("BaseRTRefStats")})
        self._call("baseRT_ref_stats", self.handle, out)
        return {name: int(getattr(out, name)) for name in STAT_FIELDS}

    def lane_info(self, lane_tag: int) -> LaneInfo:
        """The engine's view of lane ``lane_tag``; AbiError(REJECT_UNKNOWN_LANE) if it holds none."""
        out = self.ffi.new("BaseRTRefLaneInfo *", {"struct_size": self.ffi.sizeof("BaseRTRefLaneInfo")})
        self._call("baseRT_ref_lane_info", self.handle, lane_tag, out)
        return LaneInfo(**{f.name: int(getattr(out, f.name)) for f in fields(LaneInfo)})

    def space_info(self, seq: int, space_id: int) -> SpaceInfo:
        """The engine's view of space ``space_id`` of sequence ``seq`` (an id of this Bundle).
        AbiError(ERR_UNKNOWN_HANDLE) for an unknown sequence or space."""
        out = self.ffi.new("BaseRTRefSpaceInfo *", {"struct_size": self.ffi.sizeof("BaseRTRefSpaceInfo")})
        self._call("baseRT_ref_space_info", self._seq(seq, "space_info"), space_id, out)
        return SpaceInfo(**{f.name: int(getattr(out, f.name)) for f in fields(SpaceInfo)})

    def set_export_checksum(self, checksum_kind: int) -> None:
        """Seal later exports with ``checksum_kind`` (ChecksumKind.FNV1A64, the default, or
        XXH3_64). AbiError(REJECT_BOUNDS) for another kind, ERR_OP_UNSUPPORTED when libxxhash
        cannot be loaded. Restores verify either kind regardless (ABI rule 103)."""
        self._call("baseRT_ref_set_export_checksum", self.handle, checksum_kind)

    def media_tower(
        self, image_token_id: int, tokens_per_image: int, boi_token_id: int = 0, eoi_token_id: int = 0
    ) -> None:
        """Give the bundle a synthetic vision tower: every image (keyed by path) becomes
        ``tokens_per_image`` placeholders of ``image_token_id`` (token ids; 0 wrappers = none).
        Without one, media_probe / media_encode raise AbiError(ERR_OP_UNSUPPORTED).
        AbiError(REJECT_BOUNDS) for 0 tokens or an id outside the vocabulary."""
        self._call(
            "baseRT_ref_media_tower",
            self.handle,
            image_token_id,
            tokens_per_image,
            boi_token_id,
            eoi_token_id,
        )

    def certify(
        self, strategy_id: str, impl_hash: bytes, config_hash: bytes, certs: Sequence[ExactnessCert]
    ) -> None:
        """Certify the combination (``strategy_id``, 32-byte ``impl_hash``, 32-byte
        ``config_hash``) with ``certs`` (their cert_id is ignored; see ``cert``): a registration of
        exactly that combination made afterwards is granted them with fresh ids; any other hash
        under the name gets none (ABI rule 117). An empty ``certs`` removes the combination.
        Raises ArgumentError (hash not 32 bytes, identity not 32 bytes, NUL in the id) or AbiError
        (REJECT_BOUNDS for a value out of range)."""
        ffi = self.ffi
        for name, h in (("impl_hash", impl_hash), ("config_hash", config_hash)):
            if len(h) != 32:
                raise ArgumentError(f"certify: {name} must be 32 bytes, got {len(h)}")
        sid = strategy_id.encode()
        if b"\0" in sid:
            raise ArgumentError("certify: strategy_id contains a NUL byte")
        keep = []
        rows = []
        for c in certs:
            ids = list(c.admissible_host_identities)
            if any(len(i) != 32 for i in ids):
                raise ArgumentError("certify: every host identity must be 32 bytes")
            arr = {"data": ffi.NULL, "count": 0, "elem_size": 32}
            if ids:
                buf = ffi.new("uint64_t[]", 4 * len(ids))  # 8-byte aligned (section C)
                ffi.memmove(buf, b"".join(ids), 32 * len(ids))
                keep.append(buf)
                arr = {"data": buf, "count": len(ids), "elem_size": 32}
            rows.append(
                {
                    "cert_id": 0,
                    "exactness": c.exactness,
                    "sampling_modes": c.sampling_modes,
                    "grammar_allowed": c.grammar_allowed,
                    "logit_bias_allowed": c.logit_bias_allowed,
                    "param_domain": c.param_domain,
                    "verification_shape_class": c.verification_shape_class,
                    "admissible_host_identities": arr,
                }
            )
        try:
            recs = ffi.new("BaseRTExactnessCert[]", rows) if rows else ffi.NULL
            array = ffi.new(
                "BaseRTArray *",
                {"data": recs, "count": len(rows), "elem_size": ffi.sizeof("BaseRTExactnessCert")},
            )[0]
        except (OverflowError, TypeError, ValueError) as e:
            raise ArgumentError(f"certify: {e}") from e
        self._call("baseRT_ref_certify", self.handle, sid, impl_hash, config_hash, array)
        del keep, recs


def _space_rows(spaces: Sequence[RefSpace]) -> list[dict]:
    rows = []
    for s in spaces:
        name = s.name.encode()
        if len(name) > 31 or b"\0" in name:
            raise ArgumentError(f"space {s.space_id}: name must be at most 31 bytes without NUL")
        rows.append(
            {
                "space_id": s.space_id,
                "kind": int(s.kind),
                "flags": int(s.flags),
                "blob_bytes": s.blob_bytes,
                "version_tag": s.version_tag,
                "snapshot_cadence": s.snapshot_cadence,
                "snapshot_interval_tokens": s.snapshot_interval_tokens,
                "name": name,
            }
        )
    return rows


def create_ref_bundle(
    config: RefConfig | None = None, *, lib: BasertLib | None = None, **overrides
) -> RefBundle:
    """A fresh reference bundle from ``config`` (default ``RefConfig()``) with ``overrides``
    applied (``create_ref_bundle(vocab_size=64)``), driven through ``basertd.native.abi``.

    Raises ``ArgumentError`` for values that do not fit the C config, ``AbiError`` with
    REJECT_BOUNDS for a config the engine refuses (see baseRT_ref_create_checked) and
    FileNotFoundError when the engine is not built."""
    try:
        cfg = replace(config or RefConfig(), **overrides)
    except TypeError as e:
        raise ArgumentError(f"RefConfig: {e}") from e
    lib = lib or open_ref_lib()
    ffi = lib.ffi
    c = ffi.new("BaseRTRefConfig *")
    lib.lib.baseRT_ref_config_init(c)
    keep = []
    try:
        for name in (
            "vocab_size",
            "max_lanes",
            "max_batch_size",
            "page_size_tokens",
            "bytes_per_token",
            "pool_bytes",
            "context_length",
            "eos_token",
            "eos_period",
            "tick_delay_us",
            "seed_lease_ticks",
            "kernel_caps",
            "n_layers",
            "prefill_step_tokens",
            "prefill_step_us",
        ):
            setattr(c, name, getattr(cfg, name))
        if cfg.scripted_tokens:
            toks = ffi.new("uint32_t[]", list(cfg.scripted_tokens))
            keep.append(toks)
            c.scripted_tokens = toks
            c.n_scripted_tokens = len(cfg.scripted_tokens)
        if cfg.spaces:
            sp = ffi.new("BaseRTRefSpace[]", _space_rows(cfg.spaces))
            keep.append(sp)
            c.spaces = sp
            c.n_spaces = len(cfg.spaces)
        if cfg.identity:
            if len(cfg.identity) != 32:
                raise ArgumentError(f"identity must be 32 bytes, got {len(cfg.identity)}")
            ffi.memmove(c.identity, cfg.identity, 32)
        arch = ffi.new("char[]", cfg.arch.encode())
        keep.append(arch)
        c.arch = arch
    except (OverflowError, TypeError, ValueError) as e:
        raise ArgumentError(f"RefConfig: {e}") from e
    out = ffi.new("baseRT_model_t *")
    status = lib.lib.baseRT_ref_create_checked(c, out)
    if status:
        raise error_for(status, "baseRT_ref_create_checked")
    bundle = RefBundle(lib, out[0], lib.lib.baseRT_ref_free)
    bundle.config = cfg
    del keep
    return bundle


def _escape(text: str) -> str:
    if "\0" in text:
        raise ArgumentError("bundle strings must not contain NUL")
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


def write_ref_bundle(
    path: str | Path,
    config: RefConfig | None = None,
    *,
    add_bos: bool = False,
    prefix_cache: bool = True,
    chat_template: str = "",
    bos_token: str = "<s>",
    eos_token_text: str = "</s>",
    **overrides,
) -> Path:
    """Write a reference bundle file (the descriptor ``baseRT_load_model_ex`` of the reference
    engine loads; format in ``ref_engine/loader.c``) for ``config`` with ``overrides``, plus the
    tokenizer facts: ``add_bos`` (``baseRT_encode`` prepends BOS), ``prefix_cache`` (False: the
    bundle never reports BASERT_CAP_PREFIX_CACHE), the chat template and the BOS/EOS strings.
    Returns the path. Raises ``ArgumentError`` for values the format cannot hold."""
    try:
        cfg = replace(config or RefConfig(), **overrides)
    except TypeError as e:
        raise ArgumentError(f"RefConfig: {e}") from e
    lines = ["# basertd reference bundle (native/ref_engine/loader.c)", "basertd-ref-bundle 1"]
    for f in fields(RefConfig):
        v = getattr(cfg, f.name)
        if f.name == "spaces":
            for sp in v:
                if "," in sp.name or "\n" in sp.name or len(sp.name.encode()) > 31:
                    raise ArgumentError(f"space {sp.space_id}: name must be at most 31 bytes without ','")
                row = (sp.space_id, int(sp.kind), int(sp.flags), sp.blob_bytes, sp.version_tag)
                row += (sp.snapshot_cadence, sp.snapshot_interval_tokens, sp.name)
                lines.append("space = " + ",".join(str(x) for x in row))
        elif f.name == "scripted_tokens":
            if v:
                lines.append("scripted_tokens = " + ",".join(str(int(t)) for t in v))
        elif f.name == "identity":
            if v:
                if len(v) != 32:
                    raise ArgumentError(f"identity must be 32 bytes, got {len(v)}")
                lines.append(f"identity = {bytes(v).hex()}")
        elif f.name == "arch":
            lines.append(f"arch = {_escape(str(v))}")
        else:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ArgumentError(f"RefConfig.{f.name} must be a non-negative integer, got {v!r}")
            lines.append(f"{f.name} = {v}")
    lines += [
        f"add_bos = {int(bool(add_bos))}",
        f"prefix_cache = {int(bool(prefix_cache))}",
        f"bos_token = {_escape(bos_token)}",
        f"eos_token_text = {_escape(eos_token_text)}",
    ]
    if chat_template:
        lines.append(f"chat_template = {_escape(chat_template)}")
    out = Path(path)
    out.write_text("\n".join(lines) + "\n")
    return out


@functools.lru_cache(maxsize=4)
def open_ref_api_lib(path: str | None = None) -> BasertLib:
    """The reference engine with the tick ABI, the baseRT.h subset (``basertd.native.basert_api``)
    and the test surface declared; one per path per process. Raises as ``open_basert_lib``."""
    from basertd.native.basert_api import open_basert_lib

    return open_basert_lib(path or ref_engine_path(), extra_cdef=ref_cdef())


def load_ref_bundle(
    model_path: str | Path, *, lib: BasertLib | None = None, max_context: int = 0, options=None
) -> RefBundle:
    """A reference bundle loaded by path through ``baseRT_load_model_ex`` (the one loading path
    a real libbaseRT takes); ``close()`` calls ``baseRT_free_model``. ``options`` is a
    ``basert_api.LoadOptions`` (default: paged KV and prefix cache on). Raises ``LoadError``.
    ``config`` is left unset: the file is the source of truth (``stats()`` etc. still work)."""
    from basertd.native.basert_api import load_model

    loaded = load_model(lib or open_ref_api_lib(), model_path, None, max_context, options)
    bundle = loaded.bundle(RefBundle)
    bundle.loaded = loaded
    return bundle


__all__ = [
    "REF_HEADER",
    "STAT_FIELDS",
    "LaneInfo",
    "LaneState",
    "RefBundle",
    "RefConfig",
    "RefSpace",
    "RefuseKind",
    "SpaceInfo",
    "cert",
    "create_ref_bundle",
    "load_ref_bundle",
    "open_ref_api_lib",
    "open_ref_lib",
    "ref_cdef",
    "write_ref_bundle",
]
