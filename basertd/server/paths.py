"""Where the daemon's files live: the runtime directory (the client socket, the control socket,
pid and ready files), the state directory (the write-ahead log), and the socket clients connect to
by default. Each rule takes the config (``Config.runtime_dir``, ``state_dir``, ``socket``) first,
then systemd's ``$RUNTIME_DIRECTORY`` / ``$STATE_DIRECTORY``, then the system directory when
writable, then a per-user directory.

A per-user runtime directory the daemon falls back to (``<tmp>/basertd-<uid>`` in a shared,
world-writable temp dir above all) is used only when it is a real directory (not a symlink) owned
by this user and writable by no one else; another user could have created it first to receive
the daemon's sockets (``ConfigError`` otherwise, naming what is wrong).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from basertd.server.config import Config, ConfigError

SOCKET_NAME = "basertd.sock"
"""File name of the client socket inside the runtime directory."""
SYSTEM_RUNTIME_DIR = "/run/basertd"
"""The runtime directory when neither the config nor ``$RUNTIME_DIRECTORY`` names one."""
SYSTEM_STATE_DIR = "/var/lib/basertd"
"""The state directory when neither the config nor ``$STATE_DIRECTORY`` names one."""
SOCKET_ENV = "BASERTD_SOCKET"
"""Environment variable ``basertctl`` and the client read for the socket path."""


def _writable_dir(path: Path, *, create: bool) -> bool:
    """True when ``path`` is a writable directory, or could be created as one (its nearest existing
    parent is writable). With ``create`` the directory is also created."""
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o755)
        except OSError:
            return False
        return os.access(path, os.W_OK | os.X_OK)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def user_runtime_dir() -> Path:
    """The per-user fallback runtime directory: ``$XDG_RUNTIME_DIR/basertd`` when that variable
    names a directory, else ``<tmp>/basertd-<uid>``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "basertd"
    return Path(tempfile.gettempdir()) / f"basertd-{os.getuid()}"


def resolve_runtime_dir(config: Config | None = None, *, create: bool = True) -> Path:
    """The runtime directory: ``config.runtime_dir`` when set; else ``$RUNTIME_DIRECTORY`` (the
    first path when systemd lists several); else ``/run/basertd`` when writable (created if
    needed), falling back to ``user_runtime_dir()``. With ``create`` the directory is created;
    without it nothing on disk changes (``basertctl`` uses that to find the socket). Raises
    ``ConfigError`` when an explicitly configured directory cannot be created."""
    if config is not None and config.runtime_dir:
        path = Path(config.runtime_dir).expanduser()
        if create:
            try:
                path.mkdir(parents=True, exist_ok=True, mode=0o755)
            except OSError as exc:
                raise ConfigError(f"runtime_dir {path}: {exc.strerror or exc}") from None
        return path
    env = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if env:
        path = Path(env)
        if create:
            path.mkdir(parents=True, exist_ok=True, mode=0o755)
        return path
    system = Path(SYSTEM_RUNTIME_DIR)
    if _writable_dir(system, create=create) or (not create and (system / SOCKET_NAME).exists()):
        return system
    path = user_runtime_dir()
    if create:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_private(path)
    return path


def check_private(path: Path) -> None:
    """Raise ``ConfigError`` unless ``path`` is a directory (not a symlink) owned by this process's
    effective uid and writable by neither its group nor others (module docstring)."""
    st = os.lstat(path)
    why = ""
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        why = "is not a directory (a symlink or a file)"
    elif st.st_uid != os.geteuid():
        why = f"is owned by uid {st.st_uid}, not {os.geteuid()}"
    elif st.st_mode & 0o022:
        why = f"has mode {stat.S_IMODE(st.st_mode):04o}: others may write into it"
    if why:
        raise ConfigError(
            f"runtime directory {path} {why}; another user may have created it to take the "
            "daemon's sockets: remove it, or set runtime_dir"
        )


def socket_path(config: Config, runtime_dir: Path) -> Path:
    """The client socket of ``config``: the key ``socket`` when set, else
    ``<runtime_dir>/basertd.sock``."""
    return Path(config.socket).expanduser() if config.socket else runtime_dir / SOCKET_NAME


def default_socket_path() -> Path:
    """The socket ``basertctl`` and the client library connect to by default:
    ``$BASERTD_SOCKET``, else ``basertd.sock`` in the runtime directory a default ``basertd serve``
    would use (``resolve_runtime_dir`` without creating anything)."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return Path(env)
    return resolve_runtime_dir(None, create=False) / SOCKET_NAME


def user_state_dir() -> Path:
    """The per-user fallback state directory: ``$XDG_STATE_HOME/basertd`` when that variable is an
    absolute path, else ``~/.local/state/basertd``."""
    xdg = os.environ.get("XDG_STATE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "state"
    return base / "basertd"


def resolve_state_dir(config: Config | None = None, *, create: bool = True) -> Path:
    """The state directory (the write-ahead log lives there): ``config.state_dir`` when set; else
    ``$STATE_DIRECTORY`` (the first path when systemd lists several); else ``/var/lib/basertd``
    when writable (created if needed); else ``user_state_dir()``. With ``create`` the directory is
    created (0700 when per-user); without it nothing on disk changes (``basertctl wal check``
    uses that). Raises ``ConfigError`` when the configured or systemd-given directory cannot be
    created."""
    if config is not None and config.state_dir:
        path = Path(config.state_dir).expanduser()
    else:
        path = Path(os.environ.get("STATE_DIRECTORY", "").split(":")[0])
    if str(path) not in ("", "."):
        if create:
            try:
                path.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                raise ConfigError(f"state_dir {path}: {exc.strerror or exc}") from None
        return path
    system = Path(SYSTEM_STATE_DIR)
    if _writable_dir(system, create=create) or (
        not create and system.is_dir() and os.access(system, os.R_OK)
    ):
        return system
    path = user_state_dir()
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigError(f"state_dir {path}: {exc.strerror or exc}") from None
    return path
