"""``basertd``: the coordinator daemon's command line.

``basertd serve [--config FILE] [--http HOST:PORT] [--wal-recover=truncate]`` runs the daemon in
the foreground until SIGTERM (drain, then stop) or SIGINT (stop now); SIGHUP reloads FILE
(``basertd.server.daemon``). Exit status: 0 after a clean stop, 2 for a bad command line or
configuration (the message names the key; also an HTTP listener on a non-loopback address
without ``[http] api_key_file``, one line), 1 when the daemon cannot start (socket in use, model
unavailable, state directory locked, full or not writable, write-ahead log corrupt, ...), 74
(``EX_IOERR``) when the write-ahead log failed while serving (a write, an fsync: the daemon
stopped acknowledging and exits so that ``Restart=on-failure`` restarts it). ``--wal-recover=truncate``
starts on a corrupt write-ahead log by keeping it up to the corrupt record (the rest is renamed
``*.corrupt``; ``basertd.server.durability.wal``); the default, ``refuse``, does not start and says so.
"""

from __future__ import annotations

import asyncio
import sys

import click
import msgspec

import basertd.lean_structlog  # noqa: F401  (first: structlog without rich)
from basertd.server.config import ConfigError, load_config


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """basertd: serving daemon for LLM inference."""


@cli.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="TOML configuration file (default: every key at its default).",
)
@click.option(
    "--http",
    multiple=True,
    metavar="HOST:PORT",
    help="serve the OpenAI-compatible API here instead of [http] listen (repeatable; unix:PATH too).",
)
@click.option(
    "--wal-recover",
    type=click.Choice(["refuse", "truncate"]),
    default="refuse",
    show_default=True,
    help="a corrupt write-ahead log: refuse to start, or drop it from the corrupt record on",
)
def serve(config_path: str | None, http: tuple[str, ...], wal_recover: str) -> None:
    """Run the daemon in the foreground: SIGTERM drains then stops, SIGINT stops now, SIGHUP
    reloads the configuration file."""
    try:
        config = load_config(config_path)
        if http:
            config.http = msgspec.structs.replace(config.http, listen=list(http))
            config.http.__post_init__()
    except (ConfigError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    insecure = config.http.insecure_listeners()
    if insecure:
        click.echo(
            f"basertd: refusing to serve HTTP on non-loopback {', '.join(insecure)} without "
            "[http] api_key_file",
            err=True,
        )
        sys.exit(2)
    from basertd.models import ModelUnavailable
    from basertd.server.durability.wal_format import WalError
    from basertd.server.launch import configure_logging, launch
    from basertd.server.request.tokenizer import TokenizerError
    from basertd.server.workers.environment import hide_gpus

    hide_gpus()  # the workers own the GPUs; the coordinator's vocabulary loads never touch one
    configure_logging(config.log_level)
    try:
        # The workers are spawned before the daemon's own modules are imported: their start
        # (imports, model load) overlaps those imports (basertd.server.launch).
        launched = launch(config, wal_recover=wal_recover)
        try:
            from basertd.server.daemon import run
        except BaseException:
            launched.abandon()
            raise
        code = asyncio.run(run(config, config_path=config_path, wal_recover=wal_recover, launched=launched))
    except (OSError, ModelUnavailable, ConfigError, TokenizerError, WalError) as exc:
        click.echo(f"basertd: cannot start: {exc}", err=True)
        sys.exit(1)
    sys.exit(code)


def main() -> int:
    """Console-script entry point."""
    cli.main(prog_name="basertd")
    return 0


if __name__ == "__main__":
    main()
