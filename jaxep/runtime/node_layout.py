"""The node layout: G, the ranks per node, agreed by every rank at `jaxep.initialize`.

A node is a group of G consecutive ranks (rank = node * G + local index) whose GPUs reach each
other over NVLink / P2P; ranks of different nodes talk over the network. G decides the combine's
reduction order on every backend (docs/design.md) and, on the CUDA backend, which peers are
NVLink peers. It comes from the machine or from `Config.ranks_per_node`:

  - machine (override None): every rank publishes its host under jaxep/host/<generation>/<rank> in
    jax.distributed's key-value store and reads every rank's. The ranks of one host must be
    contiguous and every host must hold the same number of ranks; G is that number.
        hosts [a, a, a, a, b, b, b, b]  ->  G = 4 (2 nodes x 4)
        hosts [a, a, a, b, b, b, b, b]  ->  error: unequal nodes (a: 3 ranks, b: 5)
        hosts [a, b, a, b]              ->  error: host a's ranks 0, 2 are not contiguous
  - override G: G must divide the number of ranks and each node (ranks nG .. nG+G-1) must lie on
    one host. A host may hold several nodes (8 ranks sharing one GPU as 2 x 4: the one-GPU
    emulation of two nodes); a node never spans hosts (NVLink peers cannot be on two machines).
        hosts [a] * 8, G = 4            ->  4
        hosts [a] * 4 + [b] * 4, G = 8  ->  error: node 0 spans hosts a and b

Every rank computes G from the same list of hosts, so all return the same G or all raise the same
RuntimeError (only a rank that never publishes makes the others' messages differ: they time out).

A host is `socket.gethostname()` plus the kernel's boot id where Linux has one: two machines that
report the same hostname (containers called "localhost") are still two hosts; containers of one
machine that share its hostname are one.
"""
from __future__ import annotations

import socket

_PREFIX = "jaxep.initialize: node layout: "
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _fail(msg: str):
    raise RuntimeError(_PREFIX + msg)


def _ranks_text(ranks) -> str:
    """Ascending ranks as runs: [0, 1, 2, 3, 6] -> '0-3, 6'."""
    runs = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _by_host(hosts) -> dict:
    """{host: its ranks ascending}, hosts in the order of their first rank."""
    out = {}
    for r, h in enumerate(hosts):
        out.setdefault(h, []).append(r)
    return out


def describe_hosts(hosts) -> str:
    """'hostA: ranks 0-3; hostB: ranks 4-7' (the hosts -> ranks map every error names)."""
    return "; ".join(f"{h}: ranks {_ranks_text(rs)}" for h, rs in _by_host(hosts).items())


def _machine_layout(hosts) -> int:
    """G from the machine: the ranks of each host are one contiguous run, all runs equally long."""
    groups = _by_host(hosts)
    split = [h for h, rs in groups.items() if rs[-1] - rs[0] + 1 != len(rs)]
    if split:
        _fail(f"the ranks of a host must be contiguous (rank = node * ranks_per_node + local "
              f"index), but {', '.join(split)} {'has' if len(split) == 1 else 'have'} ranks "
              f"interleaved with another host's; hosts -> ranks: {describe_hosts(hosts)}. Start "
              "the processes of each host with consecutive process ids (jaxep.launch --node_rank "
              "does; srun --distribution=block)")
    counts = {len(rs) for rs in groups.values()}
    if len(counts) > 1:
        _fail(f"every node must hold the same number of ranks, but the hosts hold "
              f"{', '.join(f'{h}: {len(rs)}' for h, rs in groups.items())}; hosts -> ranks: "
              f"{describe_hosts(hosts)}. Start the same number of processes on every host")
    # Here: hosts == [h_0] * G + [h_1] * G + ..., so rank r is on node r // G.
    return counts.pop()


def _override_layout(hosts, override: int) -> int:
    """G = override: it divides the rank count and no node of G consecutive ranks spans hosts."""
    if isinstance(override, bool) or not isinstance(override, int) or override < 1:
        _fail(f"Config.ranks_per_node must be an int >= 1, got {override!r}")
    n = len(hosts)
    if n % override:
        _fail(f"Config.ranks_per_node={override} must divide the number of ranks {n} "
              f"(rank = node * ranks_per_node + local index), got {n} % {override} = "
              f"{n % override}")
    for node in range(n // override):
        on = dict.fromkeys(hosts[node * override:(node + 1) * override])
        if len(on) > 1:
            _fail(f"Config.ranks_per_node={override} puts ranks of different hosts in one node: "
                  f"node {node} (ranks {node * override}-{(node + 1) * override - 1}) spans "
                  f"{', '.join(on)}, and NVLink peers cannot span hosts; hosts -> ranks: "
                  f"{describe_hosts(hosts)}. Use a ranks_per_node that divides every host's "
                  "count, or None to read the layout from the machine")
    return override


def layout_from_hosts(hosts: list[str], override: int | None = None) -> int:
    """G, the ranks per node, for ranks whose hosts are `hosts` (hosts[r] = rank r's host).

    With `override` None: the machine's layout (hosts contiguous, all of one size). Else
    `override`, checked to divide len(hosts) and to keep every node on one host. Raises
    RuntimeError naming the hosts and their ranks otherwise (see the module docstring).
    """
    hosts = list(hosts)
    if not hosts:
        _fail("no ranks: the list of hosts is empty")
    if override is None:
        return _machine_layout(hosts)
    return _override_layout(hosts, override)


def this_host() -> str:
    """This machine's name: the hostname, plus the first 8 hex digits of the kernel's boot id
    where it can be read (so equal hostnames of different machines differ)."""
    name = socket.gethostname()
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip().replace("-", "")[:8]
    except OSError:
        boot = ""
    return f"{name} (boot {boot})" if boot else name


def gather_hosts(client, rank: int, nproc: int, generation: int, *, hostname: str | None = None,
                 timeout_ms: int = 60000) -> list[str]:
    """Every rank's host, in rank order, through jax.distributed's key-value store (`client`:
    jaxep._jax_private.distributed_client()). Collective: every rank calls it with the same
    `generation` (a fresh one after a failed attempt).

    Rank `rank` publishes `hostname` (default: this_host()) under jaxep/host/<generation>/<rank>
    and reads every rank's; RuntimeError naming the rank when one does not publish within
    `timeout_ms`.
    """
    if not 0 <= rank < nproc:
        _fail(f"rank must be in [0, {nproc}), got rank={rank} of nproc={nproc}")
    mine = this_host() if hostname is None else hostname
    if not isinstance(mine, str) or not mine:
        _fail(f"hostname must be a non-empty str, got {mine!r}")
    key = f"jaxep/host/{generation}"
    client.key_value_set(f"{key}/{rank}", mine)
    hosts = []
    for r in range(nproc):
        if r == rank:
            hosts.append(mine)
            continue
        try:
            hosts.append(client.blocking_key_value_get(f"{key}/{r}", timeout_ms))
        except Exception as e:  # pylint: disable=broad-except
            _fail(f"rank {r} did not publish its host within {timeout_ms / 1000:g} s (it failed "
                  f"earlier in jaxep.initialize, or never called it): {type(e).__name__}: {e}")
    return hosts


def discover(client, rank: int, nproc: int, generation: int, *, hostname: str | None = None,
             override: int | None = None, timeout_ms: int = 60000) -> int:
    """G, the ranks per node, agreed by all `nproc` ranks: layout_from_hosts(gather_hosts(...),
    override). Raises RuntimeError, the same text on every rank, when the layout does not fit."""
    hosts = gather_hosts(client, rank, nproc, generation, hostname=hostname,
                         timeout_ms=timeout_ms)
    return layout_from_hosts(hosts, override)
