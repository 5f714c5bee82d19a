"""`python -m jaxep.doctor --record DIR` and `--replay DIR`: what the doctor reads for the network,
captured on the node, and diagnosed again on any machine (attach the record to a bug report).

A record holds what the doctor's network readers read, and only that:
  root/...          every sysfs / procfs file and directory listing jaxep.topology.machine's readers
                    (and .qos's, .counters', .bond's: the members' PCI uevent and the mlx5 LAG's
                    debugfs) read, at their paths under /, plus empty markers for the files whose
                    existence is the fact (/dev/gdrdrv, the peer-memory modules)
  topo.txt          `nvidia-smi topo -m` (absent where it gave nothing)
  env.json          the NVSHMEM_* and NCCL_* variables and CUDA_VISIBLE_DEVICES, as set
  driver.json       jaxep.topology.machine.read_driver's facts (dma-buf as libcuda said, the verbs
                    libraries that did not load)
  commands.json     {"argv joined by spaces": "commands/NNN.txt" or null where it gave nothing}:
                    the QoS tools (mlnx_qos, dcb), ethtool -S, ofed_info -s, nvidia-smi's GPU list
  counters.json     {interval_s, before, after}: jaxep.doctor.counters.snapshot of every RDMA
                    port, twice, interval_s apart (which congestion and loss counters move, and a
                    bond's members' ethtool byte counters: each member's share, jaxep.doctor.bond)
  versions.json     python, kernel, jaxep's and NVSHMEM's package versions
  manifest.json     {format, created_utc, interval_s}
DIR ending in .tar.gz or .tgz writes (and reads) the same as one archive.

machine's readers look `_read` and `_listdir` up at call time; `traced()` swaps in recording
ones for the duration of one gathering, so a reader added there is recorded without a change here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import tarfile
import tempfile
import time

from jaxep import topology
from jaxep.topology import machine
from jaxep.doctor import bond, counters, qos, stacks
from jaxep.topology.findings import Finding

FORMAT = 1
ENV_PREFIXES = ("NVSHMEM_", "NCCL_")
ENV_KEYS = ("CUDA_VISIBLE_DEVICES",)
_ARCHIVE = (".tar.gz", ".tgz")
_MARKERS = tuple(p for p, _ in machine.PEER_MEMORY_FILES) + ("dev/gdrdrv",)
_EXTRA_COMMANDS = (("ofed_info", "-s"),
                   ("nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"))


@contextlib.contextmanager
def traced():
    """Within: every machine._read / machine._listdir call is served as usual and its result kept
    in the yielded {"files": {path: text}, "dirs": {path: [entries]}}."""
    seen = {"files": {}, "dirs": {}}
    read, listdir = machine._read, machine._listdir  # pylint: disable=protected-access

    def traced_read(path):
        text = read(path)
        if text is not None:
            seen["files"][os.fspath(path)] = text
        return text

    def traced_listdir(path):
        entries = listdir(path)
        if entries:
            seen["dirs"][os.fspath(path)] = entries
        return entries

    machine._read, machine._listdir = traced_read, traced_listdir  # pylint: disable=protected-access
    try:
        yield seen
    finally:
        machine._read, machine._listdir = read, listdir  # pylint: disable=protected-access


def environ_subset(environ) -> dict:
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(ENV_PREFIXES) or k in ENV_KEYS}


def ports_of(nics) -> tuple[dict, dict]:
    """({nic: the port NVSHMEM uses}, {nic: its QoS interfaces}) of every RDMA device."""
    return ({n.name: n.port.number for n in nics.values() if n.port},
            {n.name: machine.qos_interfaces("/", n) for n in nics.values()})


def versions() -> dict:
    """python, the OS and kernel, and the versions of jaxep, jax and the NVSHMEM wheels."""
    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None
    names = ("jaxep", "jax", "jaxlib", "nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13")
    return dict(python=platform.python_version(), os=platform.platform(),
                kernel=platform.release(), machine=platform.machine(),
                packages={n: version(n) for n in names})


class _Recorder:
    """run(argv) -> text, as qos.run_command, keeping every answer."""

    def __init__(self, run):
        self.run, self.answers = run, {}

    def __call__(self, argv):
        text = self.run(tuple(argv))
        self.answers[" ".join(argv)] = text
        return text


def _write(path, text) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _dump(path, obj) -> None:
    _write(path, json.dumps(obj, indent=1, sort_keys=True, default=list) + "\n")


def _write_root(out: str, seen: dict, exists=os.path.exists) -> None:
    """The traced files under out/root at their absolute paths; a listed entry nothing was read
    under becomes an empty directory, so the listing replays."""
    root = os.path.join(out, "root")
    for path, text in seen["files"].items():
        _write(root + os.path.abspath(path), text + "\n")
    for path, entries in seen["dirs"].items():
        for e in entries:
            p = root + os.path.join(os.path.abspath(path), e)
            if not os.path.exists(p):
                os.makedirs(p, exist_ok=True)
    for rel in _MARKERS:
        if exists(os.path.join("/", rel)):
            _write(os.path.join(root, rel), "")


def record(out: str, environ=None, interval_s: float = 2.0, run=qos.run_command,
           ethtool=counters.ethtool_text, topo_text: str | None = None,
           driver: machine.Driver | None = None, sleep=time.sleep) -> str:
    """Writes the record of this machine to `out` (a directory, or an archive by its suffix);
    returns its path. Reads only; `interval_s` between the two counter reads."""
    env = dict(os.environ if environ is None else environ)
    if out.endswith(_ARCHIVE):
        with tempfile.TemporaryDirectory() as tmp:
            record(os.path.join(tmp, "record"), env, interval_s, run, ethtool, topo_text, driver,
                   sleep)
            with tarfile.open(out, "w:gz") as tar:
                tar.add(os.path.join(tmp, "record"), arcname="record")
        return out
    rec = _Recorder(run)
    text = machine.read_topo_text() if topo_text is None else topo_text
    drv = machine.read_driver("/") if driver is None else driver
    kept = {}
    with traced() as seen:
        topology.summary(env, "/", text or "", None, drv)
        qos.summary(env, "/", text or "", rec, None)
        ports, ifaces = ports_of(machine.read_nics("/"))
        keep_ethtool = lambda i: kept.setdefault(i, ethtool(i))  # noqa: E731
        before = counters.snapshot("/", ports, ifaces, keep_ethtool)
    sleep(interval_s)
    after = counters.snapshot("/", ports, ifaces, ethtool)
    for argv in _EXTRA_COMMANDS:
        rec(argv)
    for i, t in kept.items():
        rec.answers[f"ethtool -S {i}"] = t
    _write_root(out, seen)
    if text:
        _write(os.path.join(out, "topo.txt"), text)
    names = {}
    for n, (cmd, answer) in enumerate(sorted(rec.answers.items())):
        names[cmd] = None if answer is None else f"commands/{n:03d}.txt"
        if answer is not None:
            _write(os.path.join(out, names[cmd]), answer)
    _dump(os.path.join(out, "commands.json"), names)
    _dump(os.path.join(out, "env.json"), environ_subset(env))
    _dump(os.path.join(out, "driver.json"), dataclasses.asdict(drv))
    _dump(os.path.join(out, "counters.json"), dict(interval_s=interval_s, before=before,
                                                   after=after))
    _dump(os.path.join(out, "versions.json"), versions())
    _dump(os.path.join(out, "manifest.json"), dict(
        format=FORMAT, tool="python -m jaxep.doctor --record", interval_s=interval_s,
        created_utc=datetime.datetime.now(datetime.timezone.utc).isoformat()))
    return out


# --- replay --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Record:
    """A record read back: `root` is its sysfs tree; `run` answers the recorded commands (None
    for one never run or that gave nothing)."""
    path: str
    root: str
    topo_text: str
    environ: dict
    driver: machine.Driver
    commands: dict
    counters: dict
    versions: dict
    manifest: dict

    def run(self, argv) -> str | None:
        name = self.commands.get(" ".join(argv))
        return _text(os.path.join(self.path, name)) if name else None


def _text(path) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _json(path, default):
    text = _text(path)
    return json.loads(text) if text else default


def load(path: str) -> Record:
    """The record at `path`: a directory, or an archive extracted to a temporary directory (kept
    for the process's life: the record's files are read lazily)."""
    if path.endswith(_ARCHIVE):
        tmp = tempfile.mkdtemp(prefix="jaxep-record-")
        with tarfile.open(path) as tar:
            tar.extractall(tmp, filter="data")
        inner = [os.path.join(tmp, d) for d in os.listdir(tmp)]
        path = inner[0] if len(inner) == 1 and os.path.isdir(inner[0]) else tmp
    manifest = _json(os.path.join(path, "manifest.json"), None)
    if manifest is None or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a jaxep doctor record of format {FORMAT} (no "
                         "manifest.json, or another format): record it with python -m "
                         "jaxep.doctor --record DIR")
    drv = _json(os.path.join(path, "driver.json"), {})
    if drv.get("missing_libraries") is not None:
        drv["missing_libraries"] = tuple(drv["missing_libraries"])
    return Record(path, os.path.join(path, "root"), _text(os.path.join(path, "topo.txt")) or "",
                  _json(os.path.join(path, "env.json"), {}),
                  machine.Driver(**drv) if drv else machine.read_driver(
                      os.path.join(path, "root"), machine="unknown"),
                  _json(os.path.join(path, "commands.json"), {}),
                  _json(os.path.join(path, "counters.json"), {}),
                  _json(os.path.join(path, "versions.json"), {}), manifest)


def counter_findings(c: dict) -> list[Finding]:
    """The congestion, loss and pause counters that moved between a record's two reads, one
    finding per counter over every NIC; and the priorities that carried the bytes."""
    if not c.get("before"):
        return []
    by = {}
    prios = {}
    for nic, before in sorted(c["before"].items()):
        if nic not in c["after"]:
            continue
        d = counters.delta(before, c["after"][nic])
        for m in counters.moved(d):
            name = m["counter"].split()[-1]
            by.setdefault(name, dict(means=m["means"], nics={}))["nics"][nic] = (
                by.get(name, {}).get("nics", {}).get(nic, 0) + m["by"])
        for p, b in counters.busy_priorities(d).items():
            prios[p] = prios.get(p, 0) + b
    secs = c.get("interval_s")
    out = [Finding("warn", f"{name} moved in {secs:g} s on {len(v['nics'])} NIC(s) ("
                   + ", ".join(f"{n} +{k:,}" for n, k in v["nics"].items()) + f"): {v['means']}",
                   "read it with the QoS findings: a lossy priority drops, PFC pauses, ECN marks; "
                   "jaxep-bench reads the same counters around its timed loop")
           for name, v in by.items()]
    if prios:
        out.append(Finding("info", "bytes sent per Ethernet priority in the record's interval "
                           "(tx_prio<N>_bytes): " + ", ".join(
                               f"priority {p} {b / 1e9:.3g} GB" for p, b in sorted(prios.items())),
                           "the priority that carried the bytes is where the traffic really went; "
                           "compare with the priorities that have PFC"))
    return out


def nvshmem_version(v: dict) -> str | None:
    """The NVSHMEM wheel's version in a record's versions.json (cu13's, else cu12's)."""
    packages = v.get("packages") or {}
    return packages.get("nvidia-nvshmem-cu13") or packages.get("nvidia-nvshmem-cu12")


def replay(path: str, nodes: int | None = None) -> dict:
    """The doctor's network diagnosis of the record at `path`: its topology summary, its RoCE QoS
    (every EP stack's priority), the counters that moved, each bond member's share of the bytes
    (`members`: {nic: jaxep.doctor.bond.shares rows}), and every finding as {level, what, hint},
    the bonds' last. A record with no GPU (no
    `nvidia-smi topo -m` GPU: taken off a GPU node) gets one finding that says so instead, as the
    doctor skips its GPU and network checks on such a machine."""
    rec = load(path)
    topo = topology.summary(rec.environ, rec.root, rec.topo_text, nodes, rec.driver)
    q = qos.summary(rec.environ, rec.root, rec.topo_text, rec.run, nodes)
    moved = [f._asdict() for f in counter_findings(rec.counters)]
    members, spread = bond.record_members(rec.root, rec.counters, nvshmem_version(rec.versions))
    findings = topo["findings"] + q["findings"] + moved + [f._asdict() for f in spread]
    if not topo["gpus"]:
        findings = [Finding("info", "the record holds no GPU (no nvidia-smi topo -m output with "
                            "GPUs): it was taken off a GPU node, where the doctor's GPU and "
                            "network checks do not apply",
                            "record on a GPU node of the cluster: python -m jaxep.doctor --record "
                            "doctor.tar.gz")._asdict()]
    return dict(record=path, manifest=rec.manifest, versions=rec.versions,
                environ=rec.environ, topology=topo, qos=q, counters=moved, members=members,
                findings=findings)


def _bond_text(bond: dict | None, nics: list, name: str) -> str:
    """"; bond0 802.3ad: 2 of 2 members up, 400 + 400 Gb/s, RDMA sees 800 Gb/s" or ""."""
    if not bond or not bond.get("bonding"):
        return ""
    b = bond["bonding"]
    up = [g for ok, g in b["members"].values() if ok]
    rate = next((n["rate_gbps"] for n in nics if n["name"] == name), None)
    mode = re.search(r"802\.3ad|active-backup|balance-\w+|broadcast", b["mode"] or "")
    return (f"; {bond['name']} {mode.group(0) if mode else '?'}: {len(up)} of {len(b['members'])} "
            f"members up, {' + '.join(f'{g:g}' for g in up if g) or '?'} Gb/s, RDMA sees "
            f"{f'{rate:g}' if rate else '?'} Gb/s")


def format_replay(d: dict) -> str:
    """The replay as text: where the record came from, what NVSHMEM makes of it, the findings."""
    v = d["versions"]
    lines = [f"replay of {d['record']} (recorded {d['manifest'].get('created_utc')}; kernel "
             f"{v.get('kernel')}, packages {v.get('packages')})",
             "NVSHMEM variables as recorded: " + (", ".join(f"{k}={x}" for k, x in
                                                           d["environ"].items()) or "none")]
    if not d["topology"]["nics"]:
        lines.append("  no RDMA NIC in the record's /sys/class/infiniband")
    lines += [f"  {line}" for line in d["topology"]["report"]]
    for n in d["qos"]["nics"]:
        lines.append(f"  {n['nic']} ({', '.join(n['interfaces'])}): trust {n['trust'] or '?'}, "
                     f"PFC on {n['pfc'] if n['pfc'] is not None else '?'}; NVSHMEM's traffic: "
                     f"{n['how']}" + _bond_text(n.get("bond"), d["topology"]["nics"], n["nic"]))
    if d["qos"]["nics"]:
        lines += ["  RoCE priority of each EP stack's traffic:"] + [
            f"  {x}" for x in stacks.grouped_lines(d["qos"]["nics"])]
    bonded = [n for n in d["qos"]["nics"] if n.get("bond")]
    if bonded:
        lines.append("  " + bond.placement_text((bonded[0]["bond"].get("lag") or {}).get("mode"),
                                                nvshmem_version(d["versions"])))
    lines += member_lines(d)
    lines.append("problems:" if d["findings"] else "problems: none")
    lines += [f"  [{p['level']}] {p['what']} -> {p['hint']}" for p in d["findings"]]
    return "\n".join(lines)


def member_lines(d: dict) -> list[str]:
    """Per bonded NIC of a replay: its members' shares of the bytes, and the LAG's port selection;
    one line saying why where the record has no member byte counters."""
    lag = {n["nic"]: (n.get("bond") or {}).get("lag") or {} for n in d["qos"]["nics"]}
    out = [f"  {nic} bytes per member in {d['manifest'].get('interval_s', '?')} s: "
           f"{bond.shares_text(rows)}; LAG port selection {bond.lag_text(lag.get(nic))}"
           for nic, rows in d["members"].items()]
    if not out and any(n.get("bond") for n in d["qos"]["nics"]):
        out.append("  bond members: the record holds no member byte counters (ethtool -S "
                   "rx|tx_bytes_phy): their shares of the bytes are unknown")
    return out
