"""``basertctl``: the operator's client of the daemon socket (issues 7 and 9).

``basertctl [--socket PATH] generate [--max-tokens N] [--temperature T] [--seed S] [--qos CLASS]
PROMPT`` streams the generated text to stdout; ``basertctl [--socket PATH] status [--json]``
prints the daemon summary, its workers, the queue per class and the prefix-cache counters.
``--socket`` defaults to ``$BASERTD_SOCKET``, then the default socket path
(``basertd.server.config.default_socket_path``). Exit status: 0 on success, 1 when the daemon
refused or failed the request (the typed error is printed on stderr), 2 for a bad command line,
3 when the daemon cannot be reached. The operators issue adds the other verbs to this group.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import msgspec

from basertd.client import Client, ClientError
from basertd.schema import control
from basertd.server.config import SOCKET_ENV, default_socket_path

EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3


def _connect(ctx: click.Context) -> Client:
    path = ctx.obj["socket"]
    try:
        return Client(path, timeout=ctx.obj.get("timeout"))
    except OSError as exc:
        click.echo(f"basertctl: cannot reach basertd at {path}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_UNREACHABLE)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help=f"daemon socket (default: ${SOCKET_ENV}, then the runtime directory's basertd.sock)",
)
@click.pass_context
def cli(ctx: click.Context, socket_path: str | None) -> None:
    """basertctl: talk to a running basertd."""
    ctx.ensure_object(dict)
    ctx.obj["socket"] = socket_path or str(default_socket_path())


@cli.command()
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="tokens to generate"
)
@click.option(
    "--temperature", type=click.FloatRange(min=0.0), default=1.0, show_default=True, help="0 is greedy"
)
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=None, help="sampling seed")
@click.option(
    "--qos",
    type=click.Choice(["interactive", "batch", "background"]),
    default="interactive",
    show_default=True,
    help="QoS class",
)
@click.option("--stop", "stops", multiple=True, help="stop string (repeatable)")
@click.argument("prompt")
@click.pass_context
def generate(
    ctx: click.Context,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    qos: str,
    stops: tuple,
    prompt: str,
) -> None:
    """Generate a continuation of PROMPT and stream it to stdout."""
    with _connect(ctx) as client:
        try:
            stream = client.stream(
                prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, qos=qos, stop=list(stops)
            )
            for delta in stream:
                if delta.text:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
        except ClientError as exc:
            sys.stdout.flush()
            click.echo(f"\nbasertctl: {exc.code}: {exc.message}", err=True)
            sys.exit(EXIT_REFUSED)
        except KeyboardInterrupt:
            client.close()  # the daemon cancels the generation when the client goes away
            sys.exit(130)
    sys.stdout.write("\n")


def _rows(result: Any, field: str) -> list[dict]:
    return [msgspec.to_builtins(r) for r in getattr(result, field)]


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of tables")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Daemon summary: workers, lanes, queue and cache."""
    with _connect(ctx) as client:
        try:
            summary = client.request(control.Status())
            workers = client.request(control.Workers())
            queue = client.request(control.Queue())
            cache = client.request(control.CacheStats())
        except ClientError as exc:
            click.echo(f"basertctl: {exc.code}: {exc.message}", err=True)
            sys.exit(EXIT_REFUSED)
    data = msgspec.to_builtins(summary)
    data.pop("type", None)
    data.pop("request_id", None)
    data["workers"] = _rows(workers, "workers")
    data["queue"] = _rows(queue, "classes")
    data["cache"] = _rows(cache, "workers")
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    click.echo(
        f"basertd {data['version']}  {data['state']}  up {data['uptime_s']:.0f}s  "
        f"workers {data['workers_ready']}/{data['workers_total']}  "
        f"lanes {data['lanes_busy']}/{data['lanes_max']}  "
        f"queued {data['queued']}  requests {data['requests_total']}"
    )
    click.echo("")
    _table(
        ["worker", "engine", "model", "state", "pid", "lanes", "queued", "respawns", "ticks"],
        [
            [
                w["worker_id"],
                w["engine"],
                w["model"],
                w["state"],
                w["pid"],
                f"{w['lanes_busy']}/{w['lanes_max']}",
                w["queue_depth"],
                w["respawns"],
                w["ticks_run"],
            ]
            for w in data["workers"]
        ],
    )
    click.echo("")
    _table(
        ["qos", "queued", "oldest wait s"],
        [[q["qos"], q["depth"], f"{q['oldest_wait_s']:.2f}"] for q in data["queue"]],
    )
    click.echo("")
    _table(
        ["worker", "cache entries", "cache bytes", "evictions"],
        [[c["worker_id"], c["entries"], c["bytes"], c["evictions"]] for c in data["cache"]],
    )


def _table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def main() -> int:
    """Console-script entry point."""
    cli.main(prog_name="basertctl")
    return 0


if __name__ == "__main__":
    main()
