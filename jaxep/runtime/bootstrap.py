"""What every rank agrees on before NVSHMEM starts, through JAX's distributed key-value store: the
configs (`agree_config`) and NVSHMEM's unique id (`exchange_unique_id`); and, on several hosts, the
interface NVSHMEM's bootstrap sockets use (`pin_interface`).

Keys live under a namespace that each `jaxep.initialize` attempt takes fresh (`generation`), so a
retry after a failure on every rank never reads the previous attempt's values.
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import os
import re
import socket
import struct

from jaxep import _jax_private

log = logging.getLogger("jaxep")

IFNAME = "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"
FAMILY = "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY"
_UID_ERROR = b"jaxep-error:"  # rank 0 publishes this instead of a unique id it could not make


def fail(msg: str):
    """Raises the RuntimeError of a failed `jaxep.initialize`."""
    raise RuntimeError("jaxep.initialize: " + msg)


def agree_config(client, config, pe: int, nproc: int, key: str, wait_ms: int,
                 extra: dict | None = None) -> None:
    """Every rank publishes `config.canonical()` (plus the `extra` fields) under
    jaxep/config/<key>/<pe> and reads every rank's; unless all equal rank 0's, every rank raises
    the same RuntimeError naming the differing fields and the ranks (so no rank goes on into
    NVSHMEM's collective init alone)."""
    key = f"jaxep/config/{key}"
    mine = config.canonical()
    if extra:
        mine = json.dumps({**json.loads(mine), **extra}, sort_keys=True)
    client.key_value_set(f"{key}/{pe}", mine)
    texts = []
    for r in range(nproc):
        try:
            texts.append(mine if r == pe else client.blocking_key_value_get(f"{key}/{r}", wait_ms))
        except Exception as e:  # pylint: disable=broad-except
            fail(f"rank {r} did not publish its config within {wait_ms / 1000:g} s (it failed "
                  f"earlier in jaxep.initialize, or never called it): {type(e).__name__}: {e}")
    base = json.loads(texts[0])
    diffs = []
    for r, text in enumerate(texts[1:], start=1):
        other = json.loads(text)
        fields = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
        if fields:
            diffs.append(f"rank {r} vs rank 0: " + ", ".join(
                f"{k}={other.get(k)!r} vs {base.get(k)!r}" for k in fields))
    if diffs:
        fail("the config must be identical on every rank (its knobs are FFI attributes: every "
              "rank must run the same kernels), but " + "; ".join(diffs))


def agree_configs(client, configs, pe: int, nproc: int, generation: int, wait_ms: int) -> None:
    """`agree_config` for each of initialize's configs: the first under the generation's key, the
    others under sub-keys, each with their number when several (so a rank with another number
    differs at the first)."""
    extra = {"number of configs": len(configs)} if len(configs) > 1 else None
    for i, c in enumerate(configs):
        agree_config(client, c, pe, nproc, str(generation) if i == 0 else f"{generation}/{i}",
                     wait_ms, extra=extra)


def exchange_unique_id(client, ext, pe: int, generation: int, wait_ms: int) -> bytes:
    """PE 0 makes NVSHMEM's unique id and publishes it; the others read it. When PE 0 cannot make
    one, it publishes the error in its place, so every rank raises at once."""
    key = f"jaxep/nvshmem_uid/{generation}"
    if pe == 0:
        try:
            uid = ext.unique_id()
        except RuntimeError as e:
            why = f"{e}: {_bootstrap_text()}"
            client.key_value_set_bytes(key, _UID_ERROR + why.encode())
            fail(why)
        client.key_value_set_bytes(key, uid)
        return bytes(uid)
    uid = bytes(client.blocking_key_value_get_bytes(key, wait_ms))
    if uid.startswith(_UID_ERROR):
        fail("rank 0 could not create NVSHMEM's unique id: "
              + uid[len(_UID_ERROR):].decode(errors="replace"))
    return uid


def _bootstrap_text() -> str:
    """What a failed unique id says: where NVSHMEM's bootstrap looked for its socket."""
    chosen = os.environ.get(IFNAME)
    where = (f"{IFNAME}={chosen}" if chosen else
             f"{IFNAME} unset: an ib* interface, else the first but docker*/lo")
    return (f"NVSHMEM's unique-id bootstrap opens its socket on an interface of this host ({where}"
            f"; family {os.environ.get(FAMILY) or 'either'}); NVSHMEM's lines above say "
            f"why it failed (\"No socket interface found\": set {IFNAME} to an "
            "interface that exists, NCCL_SOCKET_IFNAME's syntax)")


def pin_interface(hosts: int) -> None:
    """Several hosts: NVSHMEM's unique-id bootstrap listens and connects on an interface of its own
    choice (an ib* one, else the first that is not docker* or lo), which the other hosts do not
    always reach (then its init times out connecting). Unless NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME is
    set, point it at the interface through which this host reaches JAX's coordinator, a network
    every process has already used; its address family too, unless set. One host: nothing.
    One of the two os.environ writes of the library (the other: zero_copy.prepare_env)."""
    if hosts < 2:
        return
    if os.environ.get(IFNAME):
        log.info("jaxep: NVSHMEM's bootstrap uses %s=%s (set in the environment)",
                 IFNAME, os.environ[IFNAME])
        return
    try:
        address = _jax_private.coordinator_address()
    except _jax_private.JaxPrivateMoved as e:
        address = None
        log.warning("jaxep: %s", e)
    route = route_interface(address) if address else None
    if route is None or ipaddress.ip_address(route[1]).is_loopback:
        log.warning("jaxep: no interface of this host reaches JAX's coordinator (%s; route %s), so "
                    "NVSHMEM's bootstrap picks its own; if its init fails to connect, set %s to "
                    "an interface every host reaches (NCCL_SOCKET_IFNAME's syntax)",
                    address, route, IFNAME)
        return
    name, local, family = route
    os.environ[IFNAME] = "=" + name  # "=": this exact name, not a prefix
    os.environ.setdefault(FAMILY, family)
    log.info("jaxep: NVSHMEM's bootstrap set to interface %s (%s, %s), the one that reaches JAX's "
             "coordinator %s: %s=%s %s=%s (set them to choose another)", name, local, family,
             address, IFNAME, os.environ[IFNAME], FAMILY, os.environ[FAMILY])


# --- the interface a route leaves by ------------------------------------------------------------

def _split_address(address: str) -> tuple[str, int]:
    """"host:port", "[v6]:port" or a bare host -> (host, port); port 1 when absent."""
    m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:]+)(?::(\d+))?|([0-9A-Fa-f:]+)", address.strip())
    if m is None:
        raise ValueError(f"not a host:port address: {address!r}")
    host = m.group(1) or m.group(3) or m.group(5)
    return host, int(m.group(2) or m.group(4) or 1)


def interface_addresses() -> dict[str, list[tuple[int, str]]]:
    """{interface: [(family, address), ...]} of this Linux host: IPv4 by the SIOCGIFADDR ioctl,
    IPv6 from /proc/net/if_inet6."""
    table: dict[str, list[tuple[int, str]]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), 0x8915,  # SIOCGIFADDR
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            table.setdefault(name, []).append((socket.AF_INET, socket.inet_ntoa(raw[20:24])))
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            for line in f:
                hexaddr, *_, name = line.split()
                addr = str(ipaddress.IPv6Address(bytes.fromhex(hexaddr)))
                table.setdefault(name, []).append((socket.AF_INET6, addr))
    except OSError:
        pass
    return table


def route_interface(address: str, if_addrs=None) -> tuple[str, str, str] | None:
    """(interface, local IP, "AF_INET" or "AF_INET6") this host reaches `address` ("host:port")
    through: the kernel's route, read by connecting a UDP socket (nothing is sent), then the
    interface holding that source address (`interface_addresses()`, or `if_addrs` in tests:
    {name: [(family, address)]}). On the host that owns `address` it is the interface holding it.
    None when the name does not resolve, no route exists, or no interface holds the source
    address."""
    try:
        host, port = _split_address(address)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (ValueError, OSError):
        return None
    table = interface_addresses() if if_addrs is None else if_addrs
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect(sockaddr)
                local = sock.getsockname()[0]
        except OSError:
            continue
        for name, addrs in table.items():
            if any(fam == family and addr.split("%")[0] == local for fam, addr in addrs):
                return name, local, "AF_INET6" if family == socket.AF_INET6 else "AF_INET"
    return None
