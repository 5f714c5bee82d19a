"""CPU tier: jaxep.topology.machine, what this machine has for internode RDMA, read from recorded
`nvidia-smi topo -m` text and sysfs trees (tests/fixtures/topology/, described in
tests/test_topology.py), from stand-ins for libcuda and the kernel's routes, and from this machine's
own loopback; and the route to JAX's coordinator that NVSHMEM's bootstrap is pinned to
(jaxep.runtime.bootstrap.route_interface, with its own table of interface addresses)."""
import os
import socket
import subprocess

import pytest

from jaxep.topology import machine
from jaxep.runtime import bootstrap

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "topology")


def _text(case):
    with open(os.path.join(FIXTURES, case, "topo.txt")) as f:
        return f.read()


def _root(case):
    return os.path.join(FIXTURES, case, "root")


# --- parsing -------------------------------------------------------------------------------------

def test_parse_the_seed_matrix_and_legend():
    t = machine.parse_topo(_text("seed"))
    assert t.gpus == tuple(range(8)) and t.nics == tuple(f"mlx5_{i}" for i in range(8))
    assert t.link[3] == {f"mlx5_{i}": "PXB" if i == 3 else "SYS" for i in range(8)}
    assert t.numa_affinity[5] == "1" and t.cpu_affinity[0] == "0-55,112-167"


def test_parse_tolerates_ansi_underline_spaces_and_no_tail_columns():
    underlined = _text("far").replace("\tGPU0", "\t\x1b[4mGPU0").replace("GPU NUMA ID", "GPU NUMA ID\x1b[0m")
    assert machine.parse_topo(underlined) == machine.parse_topo(_text("far"))
    spaced = "        GPU0    NIC0\nGPU0     X      PIX\nNIC0    PIX      X \n\nNIC Legend:\n\n  NIC0: mlx5_4\n"
    t = machine.parse_topo(spaced)
    assert t.link == {0: {"mlx5_4": "PIX"}} and t.numa_affinity == {0: None}
    assert machine.parse_topo("") is None and machine.parse_topo("No devices were found") is None


def test_sysfs_of_the_seed():
    nics = machine.read_nics(_root("seed"))
    assert list(nics) == [f"mlx5_{i}" for i in range(8)]
    n = nics["mlx5_5"]
    assert n.numa_node == 1 and not n.bonded and n.port.active
    assert (n.port.rate_text, n.port.rate_gbps, n.port.link_layer) == (
        "800 Gb/sec (4X XDR)", 800.0, "Ethernet")
    assert n.port.gids[3] == ("0000:0000:0000:0000:0000:ffff:0a00:0105", "RoCE v2")
    assert 4 not in nics["mlx5_0"].port.gids  # the all-zero entry is unused
    assert machine.gdrcopy(_root("seed")) and not machine.gdrcopy("/nonexistent")
    assert machine.read_nics("/nonexistent") == {}


def test_sysfs_bond_through_its_gid_netdevs():
    nics = machine.read_nics(_root("bond"))
    b = nics["mlx5_bond_0"]
    assert b.bonded and b.bond == "bond0" and b.slaves == ("enp24s0f0np0", "enp24s0f1np1")
    assert b.slave_gbps == (400.0, 400.0)
    assert not nics["mlx5_2"].bonded



class _FakeCuda:
    """libcuda's three calls dma_buf_supported makes: each returns `rc`, the attribute `value`."""

    def __init__(self, rc=0, value=1):
        self.rc, self.value, self.attrs = rc, value, []

    def cuInit(self, flags):  # noqa: N802 (CUDA's names)
        return 0

    def cuDeviceGet(self, device, ordinal):  # noqa: N802
        device._obj.value = ordinal
        return 0

    def cuDeviceGetAttribute(self, value, attr, device):  # noqa: N802
        self.attrs.append((attr, device.value))
        value._obj.value = self.value
        return self.rc


@pytest.mark.parametrize("rc,value,want", [(0, 1, True), (0, 0, False), (101, 1, None)])
def test_dma_buf_supported_asks_cuda_for_its_attribute(monkeypatch, rc, value, want):
    cuda = _FakeCuda(rc, value)
    monkeypatch.setattr(machine.ctypes, "CDLL", lambda name: cuda)
    assert machine.dma_buf_supported(2) is want
    assert cuda.attrs == [(124, 2)]  # CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED of device 2


def test_dma_buf_supported_without_a_cuda_driver(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(machine.ctypes, "CDLL", missing)
    assert machine.dma_buf_supported() is None



def test_nvidia_smi_is_read_with_a_timeout(monkeypatch):
    calls = []

    def hang(cmd, **kw):
        calls.append((cmd, kw["timeout"]))
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])
    monkeypatch.setattr(machine.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(machine.subprocess, "run", hang)
    assert machine.read_topo_text() is None
    assert calls == [(["nvidia-smi", "topo", "-m"], machine.TOPO_TIMEOUT_S)]



# --- the interface a route leaves by ------------------------------------------------------------

def test_route_interface_of_loopback_on_this_machine():
    assert bootstrap.route_interface("127.0.0.1:29500") == ("lo", "127.0.0.1", "AF_INET")
    assert bootstrap.route_interface("no-such-host.invalid:1") is None
    assert bootstrap.route_interface("not an address") is None


def test_interface_addresses_of_this_machine_are_the_kernels():
    """The table route_interface reads without psutil ({name: [(family, address)]}: IPv4 by
    ioctl, IPv6 from /proc/net/if_inet6) holds loopback, and only addresses the kernel gives the
    interfaces (psutil, a jaxep dependency, reads the same through netlink)."""
    import psutil
    table = bootstrap.interface_addresses()
    assert (socket.AF_INET, "127.0.0.1") in table["lo"], table
    known = {name: {(a.family, a.address.split("%")[0]) for a in addrs}
             for name, addrs in psutil.net_if_addrs().items()}
    for name, addrs in table.items():
        assert all(isinstance(f, int) and isinstance(a, str) for f, a in addrs), addrs
        assert {(f, a.split("%")[0]) for f, a in addrs} <= known.get(name, set()), (name, addrs)


def test_route_interface_names_the_interface_holding_the_routes_source_address(monkeypatch):
    """A host with eno1 (management) first and ens2 on the coordinator's network: the kernel's
    source address for the coordinator (10.0.0.5) is ens2's, whatever the interface order."""
    table = {"lo": [(socket.AF_INET, "127.0.0.1")],
             "eno1": [(socket.AF_INET, "192.168.0.3"), (socket.AF_INET6, "fe80::1%eno1")],
             "ens2": [(socket.AF_INET6, "fd00::5"), (socket.AF_INET, "10.0.0.5")]}
    connected = []

    class Sock:
        def __init__(self, family, kind):
            self.family = family

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def connect(self, sockaddr):
            connected.append(sockaddr)

        def getsockname(self):
            return ("10.0.0.5", 40000)
    monkeypatch.setattr(bootstrap.socket, "getaddrinfo", lambda host, port, type: [
        (socket.AF_INET, type, 17, "", ("10.0.0.1", port))] if host == "node0" else [])
    monkeypatch.setattr(bootstrap.socket, "socket", Sock)
    assert bootstrap.route_interface("node0:29500", table) == ("ens2", "10.0.0.5", "AF_INET")
    assert connected == [("10.0.0.1", 29500)]  # UDP connect: nothing is sent
    assert bootstrap.route_interface("node1:29500", table) is None


@pytest.mark.parametrize("text,want", [("node0:29500", ("node0", 29500)),
                                       ("10.0.0.1:1234", ("10.0.0.1", 1234)),
                                       ("[fd00::2]:80", ("fd00::2", 80)),
                                       ("node0", ("node0", 1))])
def test_split_address(text, want):
    assert bootstrap._split_address(text) == want  # pylint: disable=protected-access


# --- the libraries NVSHMEM dlopens ------------------------------------------------------------------

def test_missing_libraries_tries_each_name_nvshmem_tries():
    tried = []

    def load(name, absent=("libmlx5.so", "libgdrapi.so.2")):
        tried.append(name)
        if name in absent:
            raise OSError(f"{name}: cannot open shared object file")
    assert machine.missing_libraries(load) == ("libgdrapi",)  # libmlx5.so.1 loads
    assert tried == ["libibverbs.so.1", "libmlx5.so", "libmlx5.so.1", "libgdrapi.so.2"]

    def none(name):
        raise OSError(name)
    assert machine.missing_libraries(none) == ("libibverbs", "libmlx5", "libgdrapi")


def test_read_driver_tries_the_libraries_only_on_this_machine(monkeypatch):
    monkeypatch.setattr(machine, "missing_libraries", lambda: ("libmlx5",))
    monkeypatch.setattr(machine, "dma_buf_supported", lambda ordinal=0: None)
    assert machine.read_driver("/").missing_libraries == ("libmlx5",)
    assert machine.read_driver(_root("seed")).missing_libraries is None
