"""CPU tier: the node layout (jaxep.runtime.node_layout). The rules on lists of hosts (layout_from_hosts,
no key-value store), `discover` over a stand-in store, and once with real processes: two
`python -m jaxep.launch --nnodes 2 --node_rank i --nproc 4` launchers (two "nodes" on this
machine, 8 CPU processes, jax.distributed's real key-value store) whose ranks claim hosts A and B
and agree on ranks_per_node."""
import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from jaxep import launch
from jaxep.runtime import node_layout

import harness  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

A4B4 = ["hostA"] * 4 + ["hostB"] * 4


# ----------------------------------------------------------------------------- the rules

@pytest.mark.parametrize("hosts,override,want", [
    (["a"], None, 1),
    (["a"] * 8, None, 8),
    (A4B4, None, 4),
    (["a", "b", "c", "d"], None, 1),             # one rank per host
    (["a"] * 2 + ["b"] * 2 + ["c"] * 2, None, 2),
    (["a"] * 8, 4, 4),                           # one host as 2 emulated nodes x 4
    (["a"] * 8, 1, 1),
    (A4B4, 2, 2),                                # each host split in two
    (A4B4, 4, 4),
    (["a"] * 6 + ["b"] * 2, 2, 2),               # unequal hosts, but every node on one host
])
def test_layouts(hosts, override, want):
    assert node_layout.layout_from_hosts(hosts, override) == want


@pytest.mark.parametrize("hosts,override,text", [
    (["a"] * 3 + ["b"] * 5, None,
     "every node must hold the same number of ranks, but the hosts hold a: 3, b: 5; hosts -> "
     "ranks: a: ranks 0-2; b: ranks 3-7"),
    (["a", "b", "a", "b"], None,
     "the ranks of a host must be contiguous (rank = node * ranks_per_node + local index), but "
     "a, b have ranks interleaved with another host's; hosts -> ranks: a: ranks 0, 2; b: ranks "
     "1, 3"),
    (["a", "a", "b", "b", "a", "a"], None, "a has ranks interleaved"),
    (A4B4, 3, "Config.ranks_per_node=3 must divide the number of ranks 8"),
    (A4B4, 8, "Config.ranks_per_node=8 puts ranks of different hosts in one node: node 0 (ranks "
              "0-7) spans hostA, hostB, and NVLink peers cannot span hosts; hosts -> ranks: "
              "hostA: ranks 0-3; hostB: ranks 4-7"),
    (["a"] * 6 + ["b"] * 2, 4, "node 1 (ranks 4-7) spans a, b"),
    (["a"] * 4, 0, "Config.ranks_per_node must be an int >= 1, got 0"),
    (["a"] * 4, True, "must be an int >= 1, got True"),
    ([], None, "no ranks"),
])
def test_layout_errors_name_hosts_and_ranks(hosts, override, text):
    with pytest.raises(RuntimeError) as e:
        node_layout.layout_from_hosts(hosts, override)
    msg = str(e.value)
    assert msg.startswith("jaxep.initialize: node layout: ") and text in msg, msg


def test_describe_hosts_compresses_runs():
    hosts = ["x", "x", "x", "y", "x", "z", "z"]
    assert node_layout.describe_hosts(hosts) == "x: ranks 0-2, 4; y: ranks 3; z: ranks 5-6"


def test_this_host_starts_with_the_hostname():
    host = node_layout.this_host()
    assert host.startswith(socket.gethostname())
    if os.path.exists("/proc/sys/kernel/random/boot_id"):
        assert re.fullmatch(re.escape(socket.gethostname()) + r" \(boot [0-9a-f]{8}\)", host)


# ----------------------------------------------------------------------------- discover, stand-in

class FakeStore:
    """jax.distributed's key-value client as far as discover uses it: values set by other ranks
    are preloaded; a missing key times out at once."""

    def __init__(self, values=None):
        self.values = dict(values or {})
        self.sets = []

    def key_value_set(self, key, value):
        assert isinstance(value, str)
        self.sets.append((key, value))
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.values:
            raise TimeoutError(f"DEADLINE_EXCEEDED: {key} after {timeout_ms} ms")
        return self.values[key]


def published(host, fab=None, blockers=()):
    return json.dumps(node_layout.rank_facts(host, fab, blockers), sort_keys=True)


def test_discover_publishes_and_reads_every_rank():
    others = {f"jaxep/host/3/{r}": published(h) for r, h in enumerate(A4B4) if r != 5}
    store = FakeStore(others)
    assert node_layout.discover(store, 5, 8, 3, hostname="hostB") == 4
    assert store.sets == [("jaxep/host/3/5", published("hostB"))]
    assert node_layout.discover(FakeStore(others), 5, 8, 3, hostname="hostB", override=2) == 2
    # This rank's own host decides too: hostA at rank 5 breaks contiguity.
    with pytest.raises(RuntimeError,
                       match="hosts -> ranks: hostA: ranks 0-3, 5; hostB: ranks 4, 6-7"):
        node_layout.discover(FakeStore(others), 5, 8, 3, hostname="hostA")


def test_discover_default_host_and_errors():
    store = FakeStore()
    assert node_layout.discover(store, 0, 1, 0) == 1
    assert store.sets == [("jaxep/host/0/0", published(node_layout.this_host()))]
    with pytest.raises(RuntimeError, match=r"rank 1 did not publish its host within 0.5 s .*"
                                           r"DEADLINE_EXCEEDED: jaxep/host/0/1"):
        node_layout.discover(FakeStore(), 0, 2, 0, hostname="a", timeout_ms=500)
    with pytest.raises(RuntimeError, match=r"rank must be in \[0, 2\), got rank=2"):
        node_layout.discover(FakeStore(), 2, 2, 0, hostname="a")
    with pytest.raises(RuntimeError, match="hostname must be a non-empty str"):
        node_layout.discover(FakeStore(), 0, 1, 0, hostname="")


# ----------------------------------------------------------------------------- real processes

LAYOUT = """
    import json, os
    import jax
    from jaxep import _jax_private
    from jaxep.runtime import node_layout

    rank, n = jax.process_index(), jax.process_count()
    client = _jax_private.distributed_client()
    a4b4 = "hostA" if rank < 4 else "hostB"
    cases = [("machine", a4b4, None), ("unequal", "hostA" if rank < 3 else "hostB", None),
             ("split", a4b4, 2), ("span", a4b4, 8)]
    # One generation per case: every case publishes under fresh keys, as a retry would.
    for generation, (name, host, override) in enumerate(cases):
        try:
            got = node_layout.discover(client, rank, n, generation, hostname=host,
                                       override=override, timeout_ms=30_000)
        except RuntimeError as e:
            got = str(e)
        print(f"RESULT {name} {json.dumps(got)}", flush=True)
    ids = [n, os.environ["JAXEP_PROCESS_ID"], os.environ["JAXEP_LOCAL_RANK"]]
    print(f"RESULT ids {json.dumps(ids)}")
"""
RESULT = re.compile(r"^\[rank (\d+)\] RESULT (\w+) (.*)$", re.M)


def _env():
    return harness.cpu_child_env(REPO)


def test_two_nodes_of_four_processes_agree_through_the_real_store(tmp_path):
    script = tmp_path / "layout.py"
    script.write_text(textwrap.dedent(LAYOUT))
    coordinator = f"127.0.0.1:{launch.free_port()}"
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "jaxep.launch", "--nnodes", "2", "--node_rank", str(i), "--nproc",
         "4", "--coordinator", coordinator, "--timeout", "80", str(script)],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=100) for p in nodes]
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, out + err
    got = {}
    for node, (out, _) in enumerate(outs):
        for rank, case, value in RESULT.findall(out):
            assert int(rank) // 4 == node  # each launcher runs its node's global ranks
            got.setdefault(case, {})[int(rank)] = json.loads(value)
    assert all(sorted(v) == list(range(8)) for v in got.values()), got
    assert got["ids"] == {r: [8, str(r), str(r % 4)] for r in range(8)}
    assert set(got["machine"].values()) == {4}
    assert set(got["split"].values()) == {2}
    for case, text in (("unequal", "the hosts hold hostA: 3, hostB: 5"),
                       ("span", "NVLink peers cannot span hosts")):
        msgs = set(got[case].values())
        assert len(msgs) == 1, msgs  # the same error on every rank
        assert text in msgs.pop()
    assert "node 1 of 2: ranks 4-7 of 8, coordinator " + coordinator in outs[1][1]


TWO_HOSTS = """
    import json, logging, os
    import jax
    from jaxep import _jax_private
    from jaxep.runtime import bootstrap, node_layout

    logging.basicConfig(level=logging.INFO)
    rank, n = jax.process_index(), jax.process_count()
    got = node_layout.discover(_jax_private.distributed_client(), rank, n, 0, timeout_ms=30_000)
    bootstrap.pin_interface(2)
    print("RESULT G " + json.dumps(got), flush=True)
    print("RESULT host " + json.dumps(node_layout.this_host()), flush=True)
    print("RESULT ifname " + json.dumps(os.environ.get("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME")), flush=True)
"""
_BOOT_ID_B = "0b0b0b0b-1111-2222-3333-444455556666"


def _under_boot_id(boot_file, command: str) -> list[str]:
    """`command` (a shell line) in a private mount namespace whose kernel boot id reads as the
    contents of `boot_file` (root and unshare(1))."""
    boot_id = node_layout._BOOT_ID  # pylint: disable=protected-access
    return ["unshare", "-m", "sh", "-c", f"mount --bind {boot_file} {boot_id} && {command}"]


def _namespaces_work(boot_file) -> bool:
    """Root with unshare(1): a private mount namespace may bind another boot id over the kernel's."""
    try:
        r = subprocess.run(_under_boot_id(boot_file, f"cat {node_layout._BOOT_ID}"),  # pylint: disable=protected-access
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and _BOOT_ID_B in r.stdout


def test_two_real_hosts_by_boot_id_agree_and_pin_nvshmems_bootstrap(tmp_path):
    """Two `jaxep.launch --nnodes 2` launchers whose processes really are on two "hosts": node 1
    runs in a mount namespace with another kernel boot id (same hostname, as two machines that
    share a name). No hostname is injected: each rank's own `this_host()` differs, the ranks agree
    on 2 per node, and each points NVSHMEM's bootstrap at the interface that holds the
    coordinator's address (not loopback). Needs root and unshare(1); the GPU run of the same
    launch is `tools/gpu.sh hosts` (docs/gpu.md; its result in docs/performance.md)."""
    boot = tmp_path / "boot_id"
    boot.write_text(_BOOT_ID_B + "\n")
    if not _namespaces_work(boot):
        pytest.skip("needs root and unshare(1) to give a process another boot id")
    import psutil
    ip = next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
               if a.family == socket.AF_INET and not a.address.startswith("127.")), None)
    if ip is None:
        pytest.skip("no non-loopback IPv4 address to serve the coordinator on")
    iface = next(name for name, addrs in psutil.net_if_addrs().items()
                 if any(a.address == ip for a in addrs))
    script = tmp_path / "two_hosts.py"
    script.write_text(textwrap.dedent(TWO_HOSTS))
    launcher = [sys.executable, "-m", "jaxep.launch", "--nnodes", "2", "--nproc", "2",
                "--coordinator", f"{ip}:{launch.free_port()}", "--timeout", "80"]
    cmds = [launcher + ["--node_rank", "0", str(script)],
            _under_boot_id(boot, "exec " + " ".join(launcher + ["--node_rank", "1", str(script)]))]
    env = dict(_env())
    env.pop("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", None)
    procs = [subprocess.Popen(c, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in cmds]
    outs = [p.communicate(timeout=100) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    got = {}
    for out, _ in outs:
        for rank, case, value in RESULT.findall(out):
            got.setdefault(case, {})[int(rank)] = json.loads(value)
    assert got["G"] == {r: 2 for r in range(4)}, got
    hosts = got["host"]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3] and "(boot 0b0b0b0b)" in hosts[2]
    assert got["ifname"] == {r: f"={iface}" for r in range(4)}
