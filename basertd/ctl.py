"""``basertctl``: the operator's client of the daemon socket (DESIGN.md "Operators").

Verbs: ``status``, ``top`` (a live view, ``basertd.ctl_top``), ``workers``, ``lanes``, ``queue``,
``cache stats|ls|pin|unpin|evict``, ``drain [--timeout S]``, ``resume``, ``worker restart ID``
(alias ``restart-worker ID``), ``generate``, ``metrics``, ``shutdown`` and ``config check FILE``.
Every verb prints a human table by default and one JSON document with ``--json`` (before or after
the verb). These two forms are stable: ``basertctl [--socket PATH] generate [--max-tokens N]
[--temperature T] [--seed S] [--qos CLASS] PROMPT`` streams the text to stdout, ``basertctl
[--socket PATH] status [--json]`` prints the summary. ``--socket`` defaults to ``$BASERTD_SOCKET``,
then the default socket path (``basertd.server.paths.default_socket_path``).

Control verbs need root, the daemon's user or its operator group (peer credentials); ``generate``
only needs access to the socket. A daemon that cannot be reached gives one line naming the socket
and what to do, never a traceback. Exit status: see ``EXIT_CODES`` (printed by ``--help``).
"""

from __future__ import annotations

import errno
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click
import msgspec

from basertd.client import Client, ClientError, ConnectionLost
from basertd.schema import control
from basertd.schema.client import ErrorCode, QosClass
from basertd.server.paths import SOCKET_ENV, default_socket_path

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_DENIED = 4
EXIT_NOT_DRAINED = 5
EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_REFUSED: (
        "the daemon refused or failed the request (typed error on stderr); config check: errors; "
        "wal check: the log is corrupt (the daemon refuses to start)"
    ),
    EXIT_USAGE: "bad command line",
    EXIT_UNREACHABLE: "the daemon cannot be reached (not running, no socket, no access to the socket)",
    EXIT_DENIED: "permission denied: control verbs need root, the daemon's user or its operator group",
    EXIT_NOT_DRAINED: "drain: the timeout passed and in-flight requests were cancelled",
}
"""basertctl's exit statuses and their meaning."""

EPILOG = "\b\nExit status:\n" + "\n".join(f"  {code}  {text}" for code, text in EXIT_CODES.items())


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"basertctl: {message}", err=True)
    sys.exit(code)


def _unreachable(path: str, exc: OSError) -> NoReturn:
    if exc.errno == errno.ENOENT:
        _fail(
            f"basertd is not running: no socket at {path}. Start it (systemctl start basertd, or "
            f"basertd serve), or point --socket / ${SOCKET_ENV} at its socket.",
            EXIT_UNREACHABLE,
        )
    if exc.errno == errno.ENOTSOCK:
        _fail(
            f"{path} is not a socket: point --socket / ${SOCKET_ENV} at basertd's socket.", EXIT_UNREACHABLE
        )
    if exc.errno == errno.ECONNREFUSED:
        _fail(
            f"basertd is not running: nothing listens on {path} (a stale socket?). Start it "
            "(systemctl start basertd, or basertd serve).",
            EXIT_UNREACHABLE,
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        _fail(
            f"no access to {path} ({exc.strerror or 'permission denied'}): join the socket's group "
            "(basertd) or run with sudo.",
            EXIT_UNREACHABLE,
        )
    _fail(f"cannot reach basertd at {path}: {exc.strerror or exc}", EXIT_UNREACHABLE)


def _connect(ctx: click.Context) -> Client:
    path = ctx.obj["socket"]
    try:
        return Client(path, timeout=ctx.obj.get("timeout"))
    except OSError as exc:
        _unreachable(path, exc)


def _client_error(ctx: click.Context, exc: ClientError) -> NoReturn:
    if isinstance(exc, ConnectionLost):
        _fail(f"lost the connection to basertd at {ctx.obj['socket']}: {exc.message}", EXIT_UNREACHABLE)
    code = EXIT_DENIED if exc.code == ErrorCode.PERMISSION_DENIED else EXIT_REFUSED
    _fail(f"{exc.code}: {exc.message}", code)


def _call(ctx: click.Context, *msgs: Any) -> list[Any]:
    """Send each control request on one connection and return the replies; exits with the right
    status (and one line on stderr) on any failure."""
    with _connect(ctx) as client:
        try:
            return [client.request(m) for m in msgs]
        except ClientError as exc:
            _client_error(ctx, exc)


def _plain(msg: Any) -> dict:
    data = msgspec.to_builtins(msg)
    data.pop("type", None)
    data.pop("request_id", None)
    return data


def _rows(result: Any, field: str) -> list[dict]:
    return [msgspec.to_builtins(r) for r in getattr(result, field)]


def _table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        click.echo("(none)")


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _output(ctx: click.Context, as_json: bool, data: Any, human: Callable[[Any], None]) -> None:
    if as_json or ctx.obj.get("json"):
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        human(data)


json_flag = click.option("--json", "as_json", is_flag=True, help="one JSON document instead of tables")
worker_option = click.option(
    "--worker", "worker_id", type=click.IntRange(min=0), default=None, help="one worker"
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(dir_okay=False, readable=False, path_type=str),  # the connect judges access (exit 3)
    default=None,
    help=f"daemon socket (default: ${SOCKET_ENV}, then the runtime directory's basertd.sock)",
)
@click.option("--json", "as_json", is_flag=True, help="JSON output for every verb")
@click.pass_context
def cli(ctx: click.Context, socket_path: str | None, as_json: bool) -> None:
    """basertctl: look at and steer a running basertd."""
    ctx.ensure_object(dict)
    ctx.obj["socket"] = socket_path or str(default_socket_path())
    ctx.obj["json"] = as_json


# --- generation --------------------------------------------------------------------------------


@cli.command(epilog=EPILOG)
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="tokens to generate"
)
@click.option(
    "--temperature", type=click.FloatRange(min=0.0), default=1.0, show_default=True, help="0 is greedy"
)
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=None, help="sampling seed (0 .. 2^64-1)")
@click.option(
    "--qos",
    type=click.Choice([q.value for q in QosClass]),
    default=QosClass.INTERACTIVE.value,
    show_default=True,
    help="QoS class",
)
@click.option("--stop", "stops", multiple=True, help="stop string (repeatable)")
@click.option(
    "--speculation",
    default="auto",
    show_default=True,
    help="auto, off, or a strategy the workers register (prompt-lookup, draft-model)",
)
@json_flag
@click.argument("prompt")
@click.pass_context
def generate(
    ctx: click.Context,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    qos: str,
    stops: tuple,
    speculation: str,
    as_json: bool,
    prompt: str,
) -> None:
    """Generate a continuation of PROMPT and stream it to stdout (open to every socket user).

    With --json nothing streams: one JSON document with the text, token ids, finish reason,
    usage, timings and seed is printed when the generation ends."""
    params = dict(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        qos=qos,
        stop=list(stops),
        speculation=speculation,
    )
    if as_json or ctx.obj.get("json"):
        with _connect(ctx) as client:
            try:
                done = client.generate(prompt, **params)
            except ClientError as exc:
                _client_error(ctx, exc)
        click.echo(json.dumps(_plain(done), indent=2, sort_keys=True))
        return
    with _connect(ctx) as client:
        try:
            stream = client.stream(prompt, **params)
            for delta in stream:
                if delta.text:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
        except ClientError as exc:
            sys.stdout.flush()
            click.echo("", err=True)
            _client_error(ctx, exc)
        except KeyboardInterrupt:
            client.close()  # the daemon cancels the generation when the client goes away
            sys.exit(130)
    sys.stdout.write("\n")


# --- views ---------------------------------------------------------------------------------------


@cli.command(epilog=EPILOG)
@json_flag
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Daemon summary: state, workers, queue per class and prefix cache."""
    summary, workers, queue, cache = _call(
        ctx, control.Status(), control.Workers(), control.Queue(), control.CacheStats()
    )
    data = _plain(summary)
    data["workers"] = _rows(workers, "workers")
    data["queue"] = _rows(queue, "classes")
    data["cache"] = _rows(cache, "workers")

    def human(d: dict) -> None:
        click.echo(
            f"basertd {d['version']}  {d['state']}  up {d['uptime_s']:.0f}s  "
            f"workers {d['workers_ready']}/{d['workers_total']}  "
            f"lanes {d['lanes_busy']}/{d['lanes_max']}  "
            f"queued {d['queued']}  requests {d['requests_total']}"
        )
        for line in d.get("problems") or ():
            click.echo(f"problem: {line}")
        for row in d.get("speculation") or ():
            click.echo(
                f"speculation {row['strategy']}: drafted {row['drafted_tokens']}  "
                f"accepted {row['accepted_tokens']}  acceptance {row['acceptance_rate']:.1%}"
            )
        for w in d["workers"] if d.get("speculation") else ():
            line = _verify_cost(w.get("engine_stats") or {})
            if line:
                click.echo(f"speculation verify cost, worker {w['worker_id']}: {line}")
        click.echo("")
        _workers_table(d["workers"])
        click.echo("")
        _queue_table(d["queue"])
        click.echo("")
        _cache_table(d["cache"])

    _output(ctx, as_json, data, human)


def _verify_cost(stats: dict[str, int]) -> str:
    """A worker engine's verify cost of a speculative round (its ``spec_verify_*`` stats, in
    thousandths of a plain decode step), or "" when it does not report one."""
    if "spec_verify_base_permille" not in stats:
        return ""
    base = stats["spec_verify_base_permille"] / 1000
    per = stats.get("spec_verify_per_draft_permille", 0) / 1000
    how = "measured" if stats.get("spec_verify_measured") else "default"
    return f"{base:.2f} + {per:.3f} x drafts plain steps ({how})"


def _engine_label(w: dict) -> str:
    """A worker's engine, with its KV layout when it has one (a llamacpp worker's)."""
    layout = w.get("kv_layout") or ""
    return f"{w['engine']} ({layout})" if layout else w["engine"]


def _workers_table(rows: list[dict]) -> None:
    _table(
        ["worker", "engine", "model", "state", "pid", "lanes", "queued", "respawns", "ticks", "pool used"],
        [
            [
                w["worker_id"],
                _engine_label(w),
                w["model"],
                w["state"],
                w["pid"],
                f"{w['lanes_busy']}/{w['lanes_max']}",
                w["queue_depth"],
                w["respawns"],
                w["ticks_run"],
                f"{_bytes(w['pool_used_bytes'])} / {_bytes(w['pool_total_bytes'])}",
            ]
            for w in rows
        ],
    )


def _queue_table(rows: list[dict]) -> None:
    _table(
        ["qos", "queued", "oldest wait s"],
        [[q["qos"], q["depth"], f"{q['oldest_wait_s']:.2f}"] for q in rows],
    )


def _cache_table(rows: list[dict]) -> None:
    _table(
        [
            "worker",
            "entries",
            "bytes",
            "pinned",
            "hits",
            "misses",
            "cached tokens",
            "evictions",
            "host",
            "host bytes",
            "restores",
            "restore s",
            "refused",
        ],
        [
            [
                c["worker_id"],
                c["entries"],
                _bytes(c["bytes"]),
                c["pinned_entries"],
                c["hits"],
                c["misses"],
                c["cached_tokens"],
                c["evictions"],
                c.get("host_entries", 0),
                f"{_bytes(c.get('host_bytes', 0))} / {_bytes(c.get('host_capacity_bytes', 0))}",
                c.get("host_restores", 0),
                f"{c.get('host_restore_s', 0.0):.3f}",
                c.get("host_refused", 0),
            ]
            for c in rows
        ],
    )


@cli.command(epilog=EPILOG)
@click.option("--once", is_flag=True, help="print one frame and exit (for scripts)")
@click.option(
    "--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True, help="seconds per frame"
)
@json_flag
@click.pass_context
def top(ctx: click.Context, once: bool, interval: float, as_json: bool) -> None:
    """A live view: workers, lanes, queues, tokens/s, TTFT and inter-token latency, cache and
    WAL; `q` quits. --json prints one overview document."""
    from basertd import ctl_top

    as_json = as_json or bool(ctx.obj.get("json"))
    if not (once or as_json or sys.stdout.isatty()):
        raise click.UsageError("the live view needs a terminal: use --once (or --json) to print one frame")
    with _connect(ctx) as client:

        def fetch() -> control.OverviewResult:
            return client.request(control.Overview())

        try:
            if as_json:
                click.echo(json.dumps(_plain(fetch()), indent=2, sort_keys=True))
                return
            ctl_top.run(fetch, once=once, interval_s=interval)
        except ClientError as exc:
            _client_error(ctx, exc)


@cli.command(epilog=EPILOG)
@json_flag
@click.pass_context
def workers(ctx: click.Context, as_json: bool) -> None:
    """One row per worker: state, pid, lanes, queue, respawns, ticks, KV pool."""
    (result,) = _call(ctx, control.Workers())
    _output(ctx, as_json, _rows(result, "workers"), _workers_table)


@cli.command(epilog=EPILOG)
@worker_option
@json_flag
@click.pass_context
def lanes(ctx: click.Context, worker_id: int | None, as_json: bool) -> None:
    """One row per live lane: request, class, phase, tokens, age (no prompt text)."""
    (result,) = _call(ctx, control.Lanes(worker_id=worker_id))

    def human(rows: list[dict]) -> None:
        _table(
            ["worker", "lane tag", "request", "qos", "state", "prompt", "generated", "cached", "age s"],
            [
                [
                    r["worker_id"],
                    r["lane_tag"],
                    r["request_id"],
                    r["qos"],
                    r["state"],
                    r["prompt_tokens"],
                    r["generated_tokens"],
                    r["cached_tokens"],
                    f"{r['age_s']:.1f}",
                ]
                for r in rows
            ],
        )

    _output(ctx, as_json, _rows(result, "lanes"), human)


@cli.command(epilog=EPILOG)
@json_flag
@click.pass_context
def queue(ctx: click.Context, as_json: bool) -> None:
    """Queued requests per QoS class and the oldest one's wait."""
    (result,) = _call(ctx, control.Queue())
    _output(ctx, as_json, _rows(result, "classes"), _queue_table)


@cli.command(epilog=EPILOG)
@json_flag
@click.pass_context
def metrics(ctx: click.Context, as_json: bool) -> None:
    """The Prometheus metrics (text exposition; --json: parsed families and samples)."""
    (result,) = _call(ctx, control.Metrics())
    if not (as_json or ctx.obj.get("json")):
        click.echo(result.text, nl=False)
        return
    from prometheus_client.parser import text_string_to_metric_families

    families = [
        {
            "name": fam.name,
            "type": fam.type,
            "help": fam.documentation,
            "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in fam.samples],
        }
        for fam in text_string_to_metric_families(result.text)
    ]
    click.echo(json.dumps(families, indent=2, sort_keys=True))


# --- prefix cache --------------------------------------------------------------------------------


@cli.group(epilog=EPILOG)
def cache() -> None:
    """Prefix cache: stats, ls, pin, unpin, evict."""


@cache.command("stats", epilog=EPILOG)
@json_flag
@click.pass_context
def cache_stats(ctx: click.Context, as_json: bool) -> None:
    """Entries, bytes, pins, hits / misses, cached tokens and evictions per worker, and the host
    tier of evicted prefixes: entries, bytes / capacity, restores, restore seconds, refused."""
    (result,) = _call(ctx, control.CacheStats())
    _output(ctx, as_json, _rows(result, "workers"), _cache_table)


@cache.command("ls", epilog=EPILOG)
@worker_option
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True, help="most entries")
@json_flag
@click.pass_context
def cache_ls(ctx: click.Context, worker_id: int | None, limit: int, as_json: bool) -> None:
    """Cached prefixes, most recently used first (token-id previews, never text)."""
    (result,) = _call(ctx, control.CacheList(worker_id=worker_id, limit=limit))

    def human(rows: list[dict]) -> None:
        _table(
            ["worker", "tokens", "bytes", "tier", "pin", "hits", "idle s", "head"],
            [
                [
                    e["worker_id"],
                    e["prefix_tokens"],
                    _bytes(e["bytes"]),
                    e["tier"],
                    e["pin_id"] or "-",
                    e["hits"],
                    f"{e['idle_s']:.0f}",
                    " ".join(map(str, e["head"][:8])),
                ]
                for e in rows
            ],
        )

    _output(ctx, as_json, _rows(result, "entries"), human)


def _token_list(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(t) for t in value.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter("token ids are integers separated by commas or spaces") from None


@cache.command("pin", epilog=EPILOG)
@click.option("--text", default=None, help="the prefix as text (tokenized by the daemon, BOS included)")
@click.option("--tokens", default=None, help="the prefix as token ids: 1,2,3")
@worker_option
@json_flag
@click.pass_context
def cache_pin(
    ctx: click.Context, text: str | None, tokens: str | None, worker_id: int | None, as_json: bool
) -> None:
    """Pin a prefix in the protected cache class (every worker unless --worker)."""
    if (text is None) == (tokens is None):
        raise click.UsageError("give exactly one of --text and --tokens")
    (result,) = _call(ctx, control.CachePin(text=text, tokens=_token_list(tokens), worker_id=worker_id))
    _output(
        ctx,
        as_json,
        _plain(result),
        lambda d: click.echo(f"pinned {d['tokens']} tokens as pin {d['pin_id']}"),
    )


@cache.command("unpin", epilog=EPILOG)
@click.argument("pin_id", type=click.IntRange(min=1))
@json_flag
@click.pass_context
def cache_unpin(ctx: click.Context, pin_id: int, as_json: bool) -> None:
    """Drop pin PIN_ID (the prefix becomes evictable)."""
    (result,) = _call(ctx, control.CacheUnpin(pin_id=pin_id))
    _output(ctx, as_json, _plain(result), lambda d: click.echo(d["message"]))


@cache.command("evict", epilog=EPILOG)
@worker_option
@click.option(
    "--bytes",
    "bytes_target",
    type=click.IntRange(min=0),
    default=0,
    help="free at most this many bytes, in whole entries, least recently used first (0: all)",
)
@json_flag
@click.pass_context
def cache_evict(ctx: click.Context, worker_id: int | None, bytes_target: int, as_json: bool) -> None:
    """Evict unpinned prefixes from the KV pool (all of them unless --bytes: whole entries up to
    that many bytes, so a bound smaller than any entry frees nothing); with a host tier ([cache]
    host_bytes) they move to host memory and are still matched."""
    (result,) = _call(ctx, control.CacheEvict(worker_id=worker_id, bytes_target=bytes_target))
    _output(
        ctx,
        as_json,
        _plain(result),
        lambda d: click.echo(
            f"freed {_bytes(d['bytes_freed'])} ({d['entries']} {'entry' if d['entries'] == 1 else 'entries'})"
        ),
    )


# --- steering ------------------------------------------------------------------------------------


@cli.command(epilog=EPILOG)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.0),
    default=30.0,
    show_default=True,
    help="seconds in-flight requests get before they are cancelled",
)
@json_flag
@click.pass_context
def drain(ctx: click.Context, timeout_s: float, as_json: bool) -> None:
    """Stop taking requests and wait for the in-flight ones; cancel what is left at the timeout.
    New requests get a typed 'draining' error until `basertctl resume`."""
    (result,) = _call(ctx, control.Drain(timeout_s=timeout_s))
    data = _plain(result)

    def human(d: dict) -> None:
        if d["drained"]:
            click.echo(f"drained in {d['waited_s']:.1f} s; new requests are refused until `basertctl resume`")
        else:
            click.echo(f"timeout after {d['waited_s']:.1f} s: {d['lanes_active']} requests cancelled")

    _output(ctx, as_json, data, human)
    if not data["drained"]:
        sys.exit(EXIT_NOT_DRAINED)


@cli.command(epilog=EPILOG)
@json_flag
@click.pass_context
def resume(ctx: click.Context, as_json: bool) -> None:
    """Accept requests again after a drain."""
    (result,) = _call(ctx, control.Resume())
    _output(ctx, as_json, _plain(result), lambda d: click.echo(d["message"]))


def _restart_worker(ctx: click.Context, worker_id: int, as_json: bool) -> None:
    (result,) = _call(ctx, control.RestartWorker(worker_id=worker_id))
    _output(
        ctx,
        as_json,
        _plain(result),
        lambda d: click.echo(f"worker {d['worker_id']} restarted: pid {d['pid']}"),
    )


@cli.group(epilog=EPILOG)
def worker() -> None:
    """One worker process."""


@worker.command("restart", epilog=EPILOG)
@click.argument("worker_id", type=click.IntRange(min=0))
@json_flag
@click.pass_context
def worker_restart(ctx: click.Context, worker_id: int, as_json: bool) -> None:
    """Replace worker WORKER_ID's process by a new one of the same configuration and wait for it:
    its running requests move to a peer serving the same model or wait for the new process, and
    resume token-exact (as a reload replacing a worker, README "Operating")."""
    _restart_worker(ctx, worker_id, as_json)


@cli.command("restart-worker", epilog=EPILOG)
@click.argument("worker_id", type=click.IntRange(min=0))
@json_flag
@click.pass_context
def restart_worker(ctx: click.Context, worker_id: int, as_json: bool) -> None:
    """The same as ``worker restart WORKER_ID`` (the older name)."""
    _restart_worker(ctx, worker_id, as_json)


@cli.command(epilog=EPILOG)
@click.option("--no-drain", is_flag=True, help="stop now: in-flight requests end with shutting_down")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.0),
    default=30.0,
    show_default=True,
    help="drain seconds before stopping",
)
@json_flag
@click.pass_context
def shutdown(ctx: click.Context, no_drain: bool, timeout_s: float, as_json: bool) -> None:
    """Stop the daemon (draining first unless --no-drain). Under systemd prefer `systemctl stop
    basertd`, or Restart=on-failure will not apply and the socket unit may start it again."""
    (result,) = _call(ctx, control.Shutdown(drain=not no_drain, timeout_s=timeout_s))
    _output(ctx, as_json, _plain(result), lambda d: click.echo(d["message"]))


@cli.group(epilog=EPILOG)
def config() -> None:
    """Configuration files."""


@config.command("check", epilog=EPILOG)
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@json_flag
@click.pass_context
def config_check(ctx: click.Context, file: Path, as_json: bool) -> None:
    """Validate FILE as basertd would, here, without a daemon; exit 1 when it has errors."""
    from basertd.server.ops.control import check_config_text

    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        result = control.ConfigCheckResult(ok=False, errors=[f"{file}: cannot read: {exc}"])
    else:
        result = check_config_text(text, str(file))
    data = _plain(result)

    def human(d: dict) -> None:
        for e in d["errors"]:
            click.echo(f"error: {e}")
        for w in d["warnings"]:
            click.echo(f"warning: {w}")
        if d["ok"]:
            click.echo(f"{file}: ok")

    _output(ctx, as_json, data, human)
    if not data["ok"]:
        sys.exit(EXIT_REFUSED)


@cli.group(epilog=EPILOG)
def wal() -> None:
    """The write-ahead log in the state directory (offline: no daemon needed)."""


@wal.command("check", epilog=EPILOG)
@click.argument("state_dir", required=False, type=click.Path(file_okay=False, exists=True, path_type=Path))
@json_flag
@click.pass_context
def wal_check(ctx: click.Context, state_dir: Path | None, as_json: bool) -> None:
    """Read the log in STATE_DIR (default: the daemon's state directory) as a start would: exit 0
    when it is clean or only torn by a crash (the start drops the torn tail), 1 when it is corrupt
    (the start refuses; `basertd serve --wal-recover=truncate` drops it from the bad record on)."""
    from basertd.server.durability.wal_recover import check_log
    from basertd.server.paths import resolve_state_dir

    path = state_dir or resolve_state_dir(None, create=False)
    if not path.is_dir():
        # No directory is not an empty log: the daemon's state directory is elsewhere (give it as
        # STATE_DIR) or the daemon never ran with durability on.
        _fail(f"no state directory at {path}: give the daemon's state_dir as STATE_DIR", EXIT_REFUSED)
    try:
        data = check_log(path)
    except OSError as exc:
        _fail(f"cannot read the write-ahead log in {path}: {exc.strerror or exc}", EXIT_REFUSED)

    def human(d: dict) -> None:
        click.echo(
            f"{d['state_dir']}: {d['status']}  epoch {d['epoch']}  segments {d['segments']}  "
            f"frames {d['frames']}  records {d['records']}  unfinished {d['unfinished']}  "
            f"results {d['results']}"
        )
        for w in d["warnings"]:
            click.echo(f"warning: {w}")
        for e in d["errors"]:
            click.echo(f"error: {e}")

    _output(ctx, as_json, data, human)
    if not data["ok"]:
        sys.exit(EXIT_REFUSED)


def main() -> int:
    """Console-script entry point."""
    cli.main(prog_name="basertctl")
    return 0


if __name__ == "__main__":
    main()
