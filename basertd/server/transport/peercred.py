"""Peer credentials of a Unix-socket client, and who may use control verbs (DESIGN.md "Operators").

``peer_credentials(sock)`` reads ``SO_PEERCRED`` (pid, uid, gid of the peer when it connected) and
``SO_PEERGROUPS`` (its supplementary groups, Linux >= 4.13) from the kernel, so nothing the client
says about itself is trusted. ``OperatorPolicy`` decides (DESIGN.md "Operators"): control verbs
are for root, the daemon's own user and members of the configured operator group; unreadable
credentials (uid -1) are refused.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from dataclasses import dataclass

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
"""Linux's socket option for the peer's supplementary groups (59 on the generic ABI)."""
MAX_PEER_GROUPS = 256
"""Supplementary groups read per peer (Python's getsockopt buffer is at most 1024 bytes); a peer in
more groups is judged by its uid and primary gid only."""


@dataclass(frozen=True)
class PeerCredentials:
    """The kernel's record of a connected peer: pid, uid, gid (-1 each when unknown) and its
    supplementary group ids."""

    pid: int = 0
    uid: int = -1
    gid: int = -1
    groups: tuple[int, ...] = ()

    def describe(self) -> str:
        """``uid 65534 (nobody), gid 65534, pid 123`` for messages and logs."""
        try:
            name = f" ({pwd.getpwuid(self.uid).pw_name})" if self.uid >= 0 else ""
        except KeyError:
            name = ""
        return f"uid {self.uid}{name}, gid {self.gid}, pid {self.pid}"


def peer_credentials(sock: socket.socket | None) -> PeerCredentials:
    """Credentials of the peer of the connected ``AF_UNIX`` socket ``sock`` (the unknown record
    when the kernel gives none)."""
    if sock is None:
        return PeerCredentials()
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
    except (OSError, AttributeError, struct.error):
        return PeerCredentials()
    groups: tuple[int, ...] = ()
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_PEER_GROUPS)
        groups = struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
    except (OSError, struct.error):
        groups = ()
    return PeerCredentials(pid=pid, uid=uid, gid=gid, groups=tuple(groups))


class OperatorPolicy:
    """Who may use control verbs: uid 0, ``daemon_uid`` (default: our effective uid), and members
    of group ``operator_group`` (a name, "" for none; looked up at every check so a reload or a
    group created later takes effect)."""

    def __init__(self, operator_group: str = "", daemon_uid: int | None = None) -> None:
        self.operator_group = operator_group
        self.daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid

    def group_id(self) -> int | None:
        """The operator group's gid, None when unset or unknown to the system."""
        if not self.operator_group:
            return None
        try:
            return grp.getgrnam(self.operator_group).gr_gid
        except KeyError:
            return None

    def allows(self, peer: PeerCredentials) -> bool:
        """True when ``peer`` may use control verbs."""
        if peer.uid < 0:
            return False
        if peer.uid in (0, self.daemon_uid):
            return True
        gid = self.group_id()
        return gid is not None and (peer.gid == gid or gid in peer.groups)

    def describe(self) -> str:
        """Who is allowed, for the refusal message."""
        try:
            me = pwd.getpwuid(self.daemon_uid).pw_name
        except KeyError:
            me = f"uid {self.daemon_uid}"
        who = f"root, user {me}"
        if self.operator_group:
            who += f" or members of group {self.operator_group}"
        return who
