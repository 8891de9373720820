"""Coordinator-side tokenizers, the incremental detokenizer and the stop-string matcher.

Tokenizing and detokenizing happen in the coordinator (DESIGN.md "Processes"), with the very vocabulary the
worker's engine uses, named by the capability record's ``TokenizerDesc``:

- ``BytesTokenizer`` ("bytes", the C reference engine): ids 0 unk, 1 BOS, 2 EOS; ids 3..258 are
  the bytes 0x00..0xFF; higher ids decode to nothing.
- ``GgufTokenizer`` ("gguf"): the model's vocabulary loaded vocab-only with llama-cpp-python (no
  weights; about 0.3 s for the 262k-token Gemma 3 vocabulary).
- ``BaseRTTokenizer`` ("basert"): a libbaseRT bundle's own tokenizer, through a tokenizer-only
  handle (``baseRT_load_tokenizer_only``) held by a small child process
  (``basertd.worker.tokenizer_proc``). A process, not an in-process binding: the coordinator never
  loads libbaseRT (the layering keeps ``basertd.native`` out of it, and a GPU runtime's start-up or
  a crash in its tokenizer stays out of the coordinator), and it never shares a handle with the
  worker, so tokenizing never waits behind a tick. Pieces are fetched once at start; encoding is
  one pipe round trip.

Generated text is streamed as UTF-8 deltas that never split a character
(``IncrementalDetokenizer``) and cut at the first stop string, holding back any tail that could
still be the beginning of one (``StopMatcher``).
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import logging
import re
import struct
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Protocol

from basertd.model_files import load_failure

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
"""Special ids of the "bytes" vocabulary."""
BYTE_BASE = 3
"""Id of byte 0x00 in the "bytes" vocabulary; byte b is id ``BYTE_BASE + b``."""


class TokenizerError(ValueError):
    """The tokenizer cannot be built (unknown kind, unreadable vocabulary) or refused a text."""


class Tokenizer(Protocol):
    """What the coordinator needs of a vocabulary. Ids are ints in ``[0, vocab_size)``."""

    kind: str
    vocab_size: int
    add_bos: bool
    """Whether the vocabulary asks for BOS before a prompt (the capability record overrides it)."""

    def encode(self, text: str, *, add_bos: bool) -> list[int]:
        """Token ids of ``text`` (UTF-8), with the BOS id first when ``add_bos`` and the vocabulary
        has one; special-token text such as ``<start_of_turn>`` is parsed as the special token."""
        ...

    def piece(self, token: int) -> bytes:
        """The bytes token ``token`` stands for in generated text (b"" for control tokens and
        unknown ids); may be part of a UTF-8 character."""
        ...


class BytesTokenizer:
    """The reference engine's vocabulary: ids 0..2 special (unk, BOS, EOS), 3..258 the bytes
    0x00..0xFF, every higher id (up to ``vocab_size``) decodes to b"". Encoding maps each UTF-8
    byte of the text to its id, so any text round-trips exactly."""

    kind = "bytes"
    add_bos = False  # the reference engine's capability record says add_bos False

    def __init__(self, vocab_size: int = BYTE_BASE + 256) -> None:
        self.vocab_size = vocab_size
        self._pieces = [b""] * BYTE_BASE + [bytes((b,)) for b in range(256)]

    def encode(self, text: str, *, add_bos: bool) -> list[int]:
        """``[BOS]`` (when ``add_bos``) then ``3 + b`` for each UTF-8 byte ``b`` of ``text``."""
        ids = [BYTE_BASE + b for b in text.encode("utf-8", "surrogatepass")]
        return [BOS_ID, *ids] if add_bos else ids

    def piece(self, token: int) -> bytes:
        """One byte for ids 3..258, b"" for the specials and any higher id."""
        return self._pieces[token] if 0 <= token < len(self._pieces) else b""


class GgufTokenizer:
    """A GGUF model's vocabulary loaded vocab-only with llama-cpp-python's low-level API
    (``llama_model_load_from_file`` with ``vocab_only``; ``llama_tokenize`` with parse_special;
    ``llama_token_to_piece`` without special tokens). Thread-safe; call ``close()`` to free it.
    Raises ``TokenizerError`` when the file cannot be loaded."""

    kind = "gguf"
    _init_lock = threading.Lock()
    _backend_ready = False

    def __init__(self, path: str) -> None:
        import llama_cpp  # the llamacpp extra; only coordinators of GGUF workers need it

        # Nothing llama.cpp logs here is the operator's business: a load failure is reported by
        # TokenizerError with its cause (``load_failure``), and with the GPUs hidden from the
        # coordinator (``workers.environment.hide_gpus``) a GPU build logs that it found no device.
        logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL)
        self._ll = llama_cpp
        with GgufTokenizer._init_lock:
            if not GgufTokenizer._backend_ready:
                llama_cpp.llama_backend_init()
                GgufTokenizer._backend_ready = True
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:  # say why: missing, not a GGUF, truncated, unsupported architecture
            raise TokenizerError(load_failure(path, f"cannot load the vocabulary of {path}"))
        self.path = str(path)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.bos_id = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.eos_id = int(llama_cpp.llama_vocab_eos(self._vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self._lock = threading.Lock()
        self._pieces: dict[int, bytes] = {}
        self._controls: dict[int, str] = {}  # id -> its text if a control token, else ""

    def encode(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        """Token ids of ``text``; BOS first when ``add_bos``; with ``special`` False, text such
        as ``<start_of_turn>`` is plain text, never the control token (llama.cpp's
        ``parse_special``). Raises ``TokenizerError`` for text that is not valid Unicode (lone
        surrogates)."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"prompt is not valid Unicode: {exc.reason}") from None
        n_max = len(data) + 8
        with self._lock:
            self._check_open()
            buf = (self._ll.llama_token * n_max)()
            n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_bos, special)
            if n < 0:  # the buffer was short: -n is the count needed
                n_max = -n
                buf = (self._ll.llama_token * n_max)()
                n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_bos, special)
        if n < 0:
            raise TokenizerError(f"llama_tokenize failed ({n})")
        return list(buf[:n])

    def encode_parts(self, parts: Sequence[tuple[str, bool]], *, add_bos: bool) -> list[int]:
        """Token ids of the concatenated ``parts`` as one special-parsing pass would make them,
        except that the text of parts with ``special`` False is never a control token: control
        texts of the other parts become their tokens, and every run of text between two of them
        (the plain parts included) is tokenized as one fragment, as llama.cpp tokenizes the
        fragments between special tokens. BOS first when ``add_bos``. Raises ``TokenizerError``
        like ``encode``."""
        runs: list[str | int] = []
        for text, special in parts:
            controls = self.control_texts_in(text) if special else frozenset()
            if not controls:
                runs.append(text)
                continue
            ordered = sorted(controls, key=len, reverse=True)
            for piece in re.split("(" + "|".join(map(re.escape, ordered)) + ")", text):
                if piece in controls:
                    runs.append(self.encode(piece, add_bos=False)[0])
                elif piece:
                    runs.append(piece)
        ids = self.encode("", add_bos=True) if add_bos else []
        text_run: list[str] = []
        for run in [*runs, -1]:
            if isinstance(run, str):
                text_run.append(run)
                continue
            if text_run:
                ids += self.encode("".join(text_run), add_bos=False, special=False)
                text_run = []
            if run >= 0:
                ids.append(run)
        return ids

    def control_texts_in(self, text: str) -> frozenset[str]:
        """The texts of the control tokens (``<start_of_turn>``, ``<eos>``, ...) that ``text``
        would be tokenized into with special parsing on: exactly what ``special`` False keeps
        as text (llama.cpp matches user-defined tokens, Gemma's whitespace runs for one, either
        way). Raises ``TokenizerError`` like ``encode``."""
        found: set[str] = set()
        for t in set(self.encode(text, add_bos=False)):
            control = self._controls.get(t)
            if control is None:
                with self._lock:
                    self._check_open()
                    attr = int(self._ll.llama_vocab_get_attr(self._vocab, t))
                is_control = attr & self._ll.LLAMA_TOKEN_ATTR_CONTROL
                control = self._controls[t] = self.token_text(t) if is_control else ""
            if control:
                found.add(control)
        return frozenset(found)

    def piece(self, token: int) -> bytes:
        """The token's bytes without special tokens (cached per id); b"" for ids out of range."""
        cached = self._pieces.get(token)
        if cached is not None:
            return cached
        if not 0 <= token < self.vocab_size:
            return b""
        with self._lock:
            self._check_open()
            size = 64
            while True:
                buf = ctypes.create_string_buffer(size)
                n = self._ll.llama_token_to_piece(self._vocab, token, buf, size, 0, False)
                if n >= 0:
                    break
                size = -n
        out = buf.raw[:n]
        self._pieces[token] = out
        return out

    def meta(self, key: str) -> str | None:
        """The GGUF metadata value of ``key`` as text (``llama_model_meta_val_str``), None when
        absent (e.g. ``meta("tokenizer.chat_template")``)."""
        with self._lock:
            self._check_open()
            size = 4096
            while True:
                buf = ctypes.create_string_buffer(size)
                n = self._ll.llama_model_meta_val_str(self._model, key.encode(), buf, size)
                if n < 0:
                    return None
                if n < size:
                    return buf.raw[:n].decode("utf-8", "replace")
                size = n + 1

    def token_text(self, token: int) -> str:
        """The text of token ``token`` as the vocabulary spells it, special tokens included ("" for
        -1 or an id out of range), e.g. ``<bos>`` for a chat template's ``bos_token``."""
        if not 0 <= token < self.vocab_size:
            return ""
        with self._lock:
            self._check_open()
            raw = self._ll.llama_vocab_get_text(self._vocab, token)
        return (raw or b"").decode("utf-8", "replace")

    def _check_open(self) -> None:
        if self._model is None:
            raise TokenizerError("tokenizer is closed")

    def close(self) -> None:
        """Free the vocabulary; idempotent."""
        with self._lock:
            if self._model is not None:
                self._ll.llama_model_free(self._model)
                self._model = None


_FRAME = struct.Struct("<I")
BASERT_TOKENIZER_START_S = 60.0
"""Seconds the tokenizer process may take to load the bundle's tokenizer and list its pieces."""


def basert_tokenizer_key(lib: str, model: str) -> str:
    """The ``path`` part of a "basert" tokenizer key: library and bundle joined by NUL (which no
    path contains). ``make_tokenizer("basert", key)`` splits it again."""
    return f"{lib}\0{model}"


class BaseRTTokenizer:
    """A libbaseRT bundle's tokenizer in a child process (module docstring). ``vocab_size``,
    ``bos_id``, ``eos_id``, ``bos_token``, ``eos_token``, ``chat_template`` (Jinja source from
    ``baseRT_chat_template_jinja``, "" when none) and ``add_bos`` come from the handle.
    Thread-safe; ``close()`` ends the process. Raises ``TokenizerError`` when the process cannot
    start or load the tokenizer (its stderr line is the message)."""

    kind = "basert"

    def __init__(self, lib: str, model: str) -> None:
        import msgspec

        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()
        self.lib, self.path = lib, model
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "basertd.worker.tokenizer_proc", "--lib", lib, "--model", model],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
        )
        try:
            info = self._call(["info"])
            pieces = self._call(["pieces"])
        except BaseException:
            self.close()
            raise
        self.vocab_size = int(info["vocab_size"])
        self.bos_id = int(info["bos_id"])
        self.eos_id = int(info["eos_id"])
        self.bos_token = str(info["bos_token"])
        self.eos_token = str(info["eos_token"])
        self.chat_template = str(info["chat_template"])
        self.add_bos = bool(info["add_bos"])
        self.version = str(info["version"])
        self._pieces: list[bytes] = [bytes(p) for p in pieces]

    def _call(self, req: list) -> object:
        with self._lock:
            proc = self._proc
            if proc is None:
                raise TokenizerError("tokenizer is closed")
            body = self._enc.encode(req)
            try:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(_FRAME.pack(len(body)) + body)
                proc.stdin.flush()
                head = proc.stdout.read(4)
                data = proc.stdout.read(_FRAME.unpack(head)[0]) if len(head) == 4 else b""
            except (OSError, struct.error):
                head = b""
            if len(head) < 4:
                err = b""
                with contextlib.suppress(Exception):
                    proc.wait(timeout=BASERT_TOKENIZER_START_S)
                    err = proc.stderr.read() if proc.stderr else b""
                line = err.decode("utf-8", "replace").strip().splitlines()
                raise TokenizerError(line[-1] if line else f"tokenizer process exited ({proc.returncode})")
        out = self._dec.decode(data)
        if isinstance(out, dict) and "error" in out:
            raise TokenizerError(str(out["error"]))
        return out

    def encode(self, text: str, *, add_bos: bool) -> list[int]:
        """``baseRT_encode`` in the tokenizer process, BOS first exactly when ``add_bos``.
        Raises ``TokenizerError`` (text with NUL or lone surrogates, a dead process)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"prompt is not valid Unicode: {exc.reason}") from None
        return [int(t) for t in self._call(["encode", text, bool(add_bos)])]  # type: ignore[union-attr]

    def piece(self, token: int) -> bytes:
        """The token's raw bytes (``baseRT_decode_token_raw``); b"" for control and unknown ids."""
        return self._pieces[token] if 0 <= token < len(self._pieces) else b""

    def close(self) -> None:
        """End the tokenizer process (its handle is freed as it exits); idempotent."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        for f in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_tokenizer(
    kind: str, path: str = "", vocab_size: int = 0
) -> BytesTokenizer | GgufTokenizer | BaseRTTokenizer:
    """The tokenizer a capability record's ``TokenizerDesc(kind, path)`` names; ``vocab_size``
    (tokens) sizes the "bytes" vocabulary; for "basert" ``path`` is ``basert_tokenizer_key(lib,
    model)``. Raises ``TokenizerError`` for an unknown kind or a tokenizer that cannot load."""
    if kind == "bytes":
        return BytesTokenizer(max(vocab_size, BYTE_BASE + 256))
    if kind == "gguf":
        return GgufTokenizer(path)
    if kind == "basert":
        lib, sep, model = path.partition("\0")
        if not sep:
            raise TokenizerError("a basert tokenizer key is basert_tokenizer_key(lib, model)")
        return BaseRTTokenizer(lib, model)
    raise TokenizerError(f"unknown tokenizer kind {kind!r}")


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that never split a UTF-8 character.

    ``feed(ids)`` returns the text completed by these tokens: bytes of an unfinished character stay
    buffered until the token that finishes it; bytes that can never form a character become U+FFFD
    (the stdlib's incremental UTF-8 decoder). ``flush()`` returns what is left at the end of the
    generation (an unfinished character becomes U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._piece = tokenizer.piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        """Text completed by ``ids`` (possibly "")."""
        data = b"".join(self._piece(int(t)) for t in ids)
        return self._decoder.decode(data, final=False) if data else ""

    def flush(self) -> str:
        """The rest at end of stream; "" when every character was complete."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Cuts a text stream at the first occurrence of any stop string, never letting the beginning
    of a stop string leak out.

    ``feed(text)`` returns ``(safe, stopped)``: ``safe`` is text that can no longer be part of a
    stop string; while the stream's tail could still begin one, that tail is held back. When a stop
    string completes, ``safe`` ends right before it and ``stopped`` is True (further input is
    ignored). ``flush()`` releases the held tail at the end of a generation that did not stop.
    Empty stop strings are ignored."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """``(safe text, stopped)``; see the class docstring."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        first: tuple[int, int, str] | None = None  # (end, start, stop) of the match that ends first
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first is None or (i + len(s), i) < first[:2]):
                first = (i + len(s), i, s)
        if first is not None:
            self._held = ""
            self.stopped = True
            self.matched = first[2]
            return buf[: first[1]], True
        hold = self._hold_length(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _hold_length(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """The held-back tail (end of a generation that did not stop); "" after a stop."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
