"""Two hosts on one machine: two network namespaces joined by a veth pair, each with a real address on its own
interface (not loopback), for multi-node jobs whose nodes must not share 127.0.0.1. Needs root (`ip netns`), as
on the build and CI machines; elsewhere the test is skipped, saying why."""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass

import pytest

IFNAME = "hdr0"  # the same name in both namespaces: GLOO_SOCKET_IFNAME is then the same on every rank


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def two_hosts(subnet: str = "10.77.0"):
    """Yield (host 0, host 1): namespaces `hdr<pid>-0/1`, addresses `<subnet>.1/.2` on `IFNAME`, lo up in each."""
    names = [f"hdr{os.getpid()}-{i}" for i in (0, 1)]
    made = subprocess.run(["ip", "netns", "add", names[0]], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"two hosts need network namespaces, which this user may not make: {made.stderr.decode()}")
    try:
        _ip("netns", "add", names[1])
        _ip("link", "add", f"{names[0][:10]}a", "type", "veth", "peer", "name", f"{names[0][:10]}b")
        hosts = []
        for i, (name, end) in enumerate(zip(names, "ab", strict=True)):
            _ip("link", "set", f"{names[0][:10]}{end}", "netns", name)
            _ip("-n", name, "link", "set", f"{names[0][:10]}{end}", "name", IFNAME)
            _ip("-n", name, "addr", "add", f"{subnet}.{i + 1}/24", "dev", IFNAME)
            _ip("-n", name, "link", "set", IFNAME, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            hosts.append(Host(name, f"{subnet}.{i + 1}"))
        yield hosts[0], hosts[1]
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
