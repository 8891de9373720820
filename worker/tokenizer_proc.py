"""``python -m basertd.worker.tokenizer_proc --lib LIB --model BUNDLE``: a tokenizer-only process
(``--lib ""``: the C reference engine).

It opens ``baseRT_load_tokenizer_only(BUNDLE)`` from ``LIB`` (``basertd.native.basert_api``) and
answers requests on stdin / stdout, so the coordinator tokenizes with the bundle's own tokenizer
without loading libbaseRT into its process (the layering keeps ``native`` out of the coordinator,
and a GPU runtime's initialisation or a crash in it stays out of the coordinator) and without
waiting behind the worker's ticks (DESIGN.md "Processes": the codec sits with the coordinator).

Frames: a u32 little-endian length, then a msgpack array. Requests and replies:

- ``["info"]`` -> ``{"vocab_size", "bos_id", "eos_id", "bos_token", "eos_token", "chat_template",
  "version"}``
- ``["pieces"]`` -> the raw bytes of every id, in id order (``baseRT_decode_token_raw``)
- ``["encode", text, add_bos]`` -> token ids (BOS first exactly when ``add_bos``)
- any failure -> ``{"error": message}``; end of stdin ends the process (status 0).

Start-up failure (library, symbols, version, bundle): one line on stderr, exit status 3.
"""

from __future__ import annotations

import argparse
import struct
import sys

import msgspec

from basertd.native import abi as nabi
from basertd.native import basert_api as api

_LEN = struct.Struct("<I")
EXIT_LOAD = 3


def _read(stream) -> bytes | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = _LEN.unpack(head)
    body = stream.read(n)
    return body if len(body) == n else None


def _encode(tok: api.TokenizerHandle, text: str, add_bos: bool) -> list[int]:
    from basertd.worker.engines.basert import encode_with_bos

    return encode_with_bos(tok, text, add_bos)


def serve(tok: api.TokenizerHandle, rfile, wfile) -> None:
    """Answer requests until end of input (module docstring)."""
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder()
    while (frame := _read(rfile)) is not None:
        try:
            req = dec.decode(frame)
            op = req[0]
            if op == "info":
                out = {
                    "vocab_size": tok.vocab_size,
                    "bos_id": tok.bos_id,
                    "eos_id": tok.eos_id,
                    "bos_token": tok.bos_token,
                    "eos_token": tok.eos_token,
                    "chat_template": tok.chat_template,
                    "version": tok.version,
                    "add_bos": _encode(tok, "", False) != tok.encode(""),
                }
            elif op == "pieces":
                out = [tok.piece(i) for i in range(tok.vocab_size)]
            elif op == "encode":
                out = _encode(tok, str(req[1]), bool(req[2]))
            else:
                out = {"error": f"unknown request {op!r}"}
        except (msgspec.DecodeError, IndexError, TypeError, ValueError, nabi.BindingError) as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        body = enc.encode(out)
        wfile.write(_LEN.pack(len(body)) + body)
        wfile.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="basertd-tokenizer", description=__doc__.splitlines()[0])
    p.add_argument("--lib", required=True)
    p.add_argument("--model", required=True)
    args = p.parse_args(argv)
    try:
        from basertd.native import ref_engine_path

        tok = api.TokenizerHandle(args.lib or ref_engine_path(), args.model)
    except (api.LoadError, nabi.LibraryError, FileNotFoundError) as exc:
        print(f"basertd-tokenizer: {exc}", file=sys.stderr)
        return EXIT_LOAD
    try:
        serve(tok, sys.stdin.buffer, sys.stdout.buffer)
    finally:
        tok.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
