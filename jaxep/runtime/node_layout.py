"""The node layout: G, the ranks per node, agreed by every rank at `jaxep.initialize`.

A node is a group of G consecutive ranks (rank = node * G + local index) whose GPUs reach each
other over NVLink / P2P; ranks of different nodes talk over the network. G decides the combine's
reduction order on every backend (docs/design.md) and, on the CUDA backend, which peers are
NVLink peers. It comes from the machine or from `Config.ranks_per_node`:

  - machine (override None): every rank publishes its facts under jaxep/host/<generation>/<rank>
    in jax.distributed's key-value store (JSON: its host, its NVLink fabric domain or null, and
    what would stop NVSHMEM from mapping that domain's peers: jaxep.topology.fabric) and reads
    every rank's. A rank's *domain* is its NVLink fabric domain (NVML: cluster UUID + clique id,
    registration completed; GB200 / GB300 NVL72: all 72 GPUs of 18 hosts), else its host (HGX,
    PCIe). The ranks of one domain must be contiguous and every domain must hold the same number
    of ranks; G is that number. The rules below read "host" for "domain" where no rank has a
    fabric (the messages then say host).
        hosts [a, a, a, a, b, b, b, b]  ->  G = 4 (2 nodes x 4)
        hosts [a, a, a, b, b, b, b, b]  ->  error: unequal nodes (a: 3 ranks, b: 5)
        hosts [a, b, a, b]              ->  error: host a's ranks 0, 2 are not contiguous
  - override G: G must divide the number of ranks and each node (ranks nG .. nG+G-1) must lie on
    one host. A host may hold several nodes (8 ranks sharing one GPU as 2 x 4: the one-GPU
    emulation of two nodes); a node never spans domains.
        hosts [a] * 8, G = 4            ->  4
        hosts [a] * 4 + [b] * 4, G = 8  ->  error: node 0 spans hosts a and b
  - a domain that spans hosts is a node only when no rank reports a blocker (fabric registration
    not completed, no IMEX channel, NVSHMEM_DISABLE_MNNVL set): otherwise every rank raises the
    same RuntimeError naming each blocker and its fix (Config.ranks_per_node = GPUs per host is
    the way around it).

Every rank computes G from the same list of hosts, so all return the same G or all raise the same
RuntimeError (only a rank that never publishes makes the others' messages differ: they time out).

A host is `socket.gethostname()` plus the kernel's boot id where Linux has one: two machines that
report the same hostname (containers called "localhost") are still two hosts; containers of one
machine that share its hostname are one.
"""
from __future__ import annotations

import json
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


def _machine_layout(hosts, unit: str = "host") -> int:
    """G from the machine: the ranks of each host (domain) are one contiguous run, all runs
    equally long."""
    groups = _by_host(hosts)
    split = [h for h, rs in groups.items() if rs[-1] - rs[0] + 1 != len(rs)]
    if split:
        _fail(f"the ranks of {'an' if unit[0] in 'AEIOUN' else 'a'} {unit} must be contiguous (rank = node * ranks_per_node + local "
              f"index), but {', '.join(split)} {'has' if len(split) == 1 else 'have'} ranks "
              f"interleaved with another {unit}'s; {unit}s -> ranks: {describe_hosts(hosts)}. "
              f"Start the processes of each {unit} with consecutive process ids (jaxep.launch "
              "--node_rank does; srun --distribution=block)")
    counts = {len(rs) for rs in groups.values()}
    if len(counts) > 1:
        _fail(f"every node must hold the same number of ranks, but the {unit}s hold "
              f"{', '.join(f'{h}: {len(rs)}' for h, rs in groups.items())}; {unit}s -> ranks: "
              f"{describe_hosts(hosts)}. Start the same number of processes on every {unit}")
    # Here: hosts == [h_0] * G + [h_1] * G + ..., so rank r is on node r // G.
    return counts.pop()


def _override_layout(hosts, override: int, unit: str = "host") -> int:
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
            _fail(f"Config.ranks_per_node={override} puts ranks of different {unit}s in one "
                  f"node: node {node} (ranks {node * override}-{(node + 1) * override - 1}) "
                  f"spans {', '.join(on)}, and NVLink peers cannot span {unit}s; {unit}s -> "
                  f"ranks: {describe_hosts(hosts)}. Use a ranks_per_node that divides every "
                  f"{unit}'s count, or None to read the layout from the machine")
    return override


def layout_from_hosts(hosts: list[str], override: int | None = None, unit: str = "host") -> int:
    """G, the ranks per node, for ranks whose hosts are `hosts` (hosts[r] = rank r's host).

    With `override` None: the machine's layout (hosts contiguous, all of one size). Else
    `override`, checked to divide len(hosts) and to keep every node on one host. Raises
    RuntimeError naming the hosts and their ranks otherwise (see the module docstring).
    """
    hosts = list(hosts)
    if not hosts:
        _fail("no ranks: the list of hosts is empty")
    if override is None:
        return _machine_layout(hosts, unit)
    return _override_layout(hosts, override, unit)


def domains(facts) -> list[str]:
    """Each rank's domain: its NVLink fabric domain, else its host (facts: gather_facts')."""
    return [f["nvlink"] or f["host"] for f in facts]


def _check_blockers(facts, g: int) -> None:
    """Raises when a node of G ranks spans hosts while some rank reports a blocker."""
    spans = any(len({f["host"] for f in facts[n:n + g]}) > 1 for n in range(0, len(facts), g))
    found = [(r, what, fix) for r, f in enumerate(facts) for what, fix in f.get("blockers", ())]
    if spans and found:
        _fail("the NVLink fabric puts the GPUs of several hosts in one domain, but NVSHMEM cannot "
              "map peers across those hosts: " + "; ".join(
                  f"rank {r}: {what} -> {fix}" for r, what, fix in found)
              + ". Or set Config.ranks_per_node to the GPUs per host (the hosts' ranks then talk "
              "over the network)")


def layout_from_facts(facts, override: int | None = None) -> int:
    """G from every rank's facts ({"host", "nvlink", "blockers"}): the layout of their domains
    (layout_from_hosts), with `override` checked against the domains too. With no fabric on any
    rank it is layout_from_hosts of the hosts, messages included."""
    fabric = any(f["nvlink"] for f in facts)
    keys = domains(facts) if fabric else [f["host"] for f in facts]
    try:
        g = layout_from_hosts(keys, override, "NVLink domain" if fabric else "host")
    except RuntimeError as e:
        notes = [f"rank {r}: {w}" for r, f in enumerate(facts) for w, _ in f.get("blockers", ())]
        if notes:
            raise RuntimeError(f"{e} (fabric not ready on: {'; '.join(notes)})") from e
        raise
    _check_blockers(facts, g)
    return g


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


def rank_facts(hostname: str | None = None, fab=None, blockers=()) -> dict:
    """What a rank publishes: {"host", "nvlink": its fabric domain or None, "blockers": [[what,
    fix]]} (fab: a jaxep.topology.fabric.Fabric or None; blockers: fabric.blockers' pairs)."""
    host = this_host() if hostname is None else hostname
    if not isinstance(host, str) or not host:
        _fail(f"hostname must be a non-empty str, got {host!r}")
    return dict(host=host, nvlink=fab.domain if fab is not None else None,
                blockers=[list(b) for b in blockers])


def gather_facts(client, rank: int, nproc: int, generation: int, mine: dict, *,
                 timeout_ms: int = 60000) -> list[dict]:
    """Every rank's facts (rank_facts), in rank order, through jax.distributed's key-value store
    (`client`: jaxep._jax_private.distributed_client()). Collective: every rank calls it with the
    same `generation` (a fresh one after a failed attempt).

    Rank `rank` publishes `mine` as JSON under jaxep/host/<generation>/<rank> and reads every
    rank's; RuntimeError naming the rank when one does not publish within `timeout_ms`.
    """
    if not 0 <= rank < nproc:
        _fail(f"rank must be in [0, {nproc}), got rank={rank} of nproc={nproc}")
    key = f"jaxep/host/{generation}"
    client.key_value_set(f"{key}/{rank}", json.dumps(mine, sort_keys=True))
    out = []
    for r in range(nproc):
        if r == rank:
            out.append(mine)
            continue
        try:
            text = client.blocking_key_value_get(f"{key}/{r}", timeout_ms)
        except Exception as e:  # pylint: disable=broad-except
            _fail(f"rank {r} did not publish its host within {timeout_ms / 1000:g} s (it failed "
                  f"earlier in jaxep.initialize, or never called it): {type(e).__name__}: {e}")
        try:
            out.append(json.loads(text))
        except ValueError:
            _fail(f"rank {r} published {text!r}, not the JSON record of rank_facts: every "
                  "rank must run the same jaxep version")
    return out


def gather_hosts(client, rank: int, nproc: int, generation: int, *, hostname: str | None = None,
                 timeout_ms: int = 60000) -> list[str]:
    """Every rank's host, in rank order (gather_facts without fabric facts)."""
    facts = gather_facts(client, rank, nproc, generation, rank_facts(hostname),
                         timeout_ms=timeout_ms)
    return [f["host"] for f in facts]


def discover(client, rank: int, nproc: int, generation: int, *, hostname: str | None = None,
             fab=None, blockers=(), override: int | None = None, timeout_ms: int = 60000) -> int:
    """G, the ranks per node, agreed by all `nproc` ranks: layout_from_facts(gather_facts(...),
    override), this rank's facts from `hostname`, `fab` and `blockers` (rank_facts). Raises
    RuntimeError, the same text on every rank, when the layout does not fit."""
    if not 0 <= rank < nproc:
        _fail(f"rank must be in [0, {nproc}), got rank={rank} of nproc={nproc}")
    facts = gather_facts(client, rank, nproc, generation, rank_facts(hostname, fab, blockers),
                         timeout_ms=timeout_ms)
    return layout_from_facts(facts, override)
