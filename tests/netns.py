"""Network namespaces as stand-in hosts, for the multi-host test.

Each "host" is a namespace with one veth into a bridge that lives in a namespace of its own
(the switch), and an address the test picks in a private /24 that no route of this machine
uses. The test's own namespace gets one veth into the switch too, so it can reach the hosts
(and nothing else is touched: removing the namespaces removes every veth). Linux only, as root.

A host can also get its own ``/etc/hosts`` (:meth:`Hosts.set_names`): ``ip netns exec`` binds
``/etc/netns/<namespace>/hosts`` over it for the processes it starts, and the resolver reads it
on every lookup, so a test can make a DNS name list instances and change the list at run time.
"""

from __future__ import annotations

import ipaddress
import os
import pathlib
import random
import shutil
import subprocess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _free_subnet() -> ipaddress.IPv4Network:
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], check=True, capture_output=True, text=True, timeout=30).stdout
    used = [ipaddress.IPv4Network(word, strict=False) for word in routes.split() if "/" in word and word[0].isdigit()]
    for _ in range(64):
        candidate = ipaddress.IPv4Network(f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.0/24")
        if not any(candidate.overlaps(u) for u in used):
            return candidate
    raise RuntimeError("no free private /24 for the test's namespaces")


def can_create_namespaces() -> str | None:
    """None if this process can create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"epd-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"cannot create a network namespace: {getattr(exc, 'stderr', exc)}"
    _ip("netns", "del", probe)
    return None


class Hosts:
    """``with Hosts(["encoder", "prefill"]) as hosts:`` then ``hosts.address["encoder"]`` and
    ``hosts.wrapper("encoder")`` (the command prefix that runs a process on that host)."""

    def __init__(self, names: list[str]) -> None:
        self._tag = f"{os.getpid() % 100000}"
        self._switch = f"epd-sw-{self._tag}"
        self._names = names
        self._created: list[str] = []
        self.address: dict[str, str] = {}
        self.device: dict[str, str] = {}  # each host's one network device (its veth)

    def namespace(self, name: str) -> str:
        return f"epd-{name}-{self._tag}"

    def wrapper(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(name)]

    def set_names(self, name: str, entries: dict[str, list[str]]) -> None:
        """What ``/etc/hosts`` says on host ``name`` (to processes started after the first call):
        each DNS name with its addresses. Rewritten in place, so running processes see it."""
        lines = ["127.0.0.1 localhost", *(f"{address} {dns_name}" for dns_name, addresses in entries.items() for address in addresses)]
        path = pathlib.Path("/etc/netns") / self.namespace(name) / "hosts"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as file:  # the same inode: the bind mount keeps showing it
            file.write("\n".join(lines) + "\n")

    def __enter__(self) -> Hosts:
        subnet = _free_subnet()
        hosts = list(subnet.hosts())
        try:
            self._add_namespace(self._switch)
            _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self._switch, "link", "set", "br0", "up")
            for index, name in enumerate(self._names):
                namespace = self.namespace(name)
                self._add_namespace(namespace)
                self.device[name] = f"h{index}-{self._tag}"
                self._wire(self.device[name], namespace, f"{hosts[index]}/{subnet.prefixlen}")
                self.address[name] = str(hosts[index])
            # This process's namespace joins the switch last, on the subnet's last address.
            self._wire(f"t-{self._tag}", None, f"{hosts[-1]}/{subnet.prefixlen}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for namespace in reversed(self._created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
            shutil.rmtree(pathlib.Path("/etc/netns") / namespace, ignore_errors=True)
        self._created.clear()
        # Gone with its peer on the switch, unless setting up failed before the peer moved.
        subprocess.run(["ip", "link", "del", f"t-{self._tag}"], capture_output=True, timeout=30)

    def _add_namespace(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self._created.append(namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")

    def _wire(self, device: str, namespace: str | None, address: str) -> None:
        """A veth pair: ``device`` in ``namespace`` (None: this process's) with ``address``, its
        peer on the switch's bridge."""
        peer = f"s{device}"[:15]
        _ip("link", "add", device, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", self._switch)
        _ip("-n", self._switch, "link", "set", peer, "master", "br0", "up")
        inside = ["-n", namespace] if namespace else []
        if namespace:
            _ip("link", "set", device, "netns", namespace)
        _ip(*inside, "addr", "add", address, "dev", device)
        _ip(*inside, "link", "set", device, "up")
