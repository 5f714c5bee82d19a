"""`python -m jaxep.doctor --explain FILE [--replay DIR]`: one account a person can act on, in
order: what the printed figures mean (jaxep.doctor.explain), the bytes each bond member carried,
the priority each EP stack's traffic lands on, the counters that moved (the record's,
jaxep.doctor.record), and the settings to change, each once. Without a record the sections that
need one say so; nothing is read from this machine's NICs and nothing is changed.
"""
from __future__ import annotations

import re

from jaxep.doctor import bond, explain, record, stacks

DEFAULT_NIC_GBPS = 100.0   # the seed's ConnectX-8: 800 Gb/s
DEFAULT_MEMBERS = 2        # run as 2 x 400GbE (CX8 firmware release notes: no 1 x 800GbE RoCE)
_SETTING = re.compile(r"[A-Z][A-Z0-9_]+=\S+")


def nic_of(replay: dict | None, nic_gbps: float | None, members: int | None) -> tuple:
    """(NIC GB/s, bond members, where they came from): the flags, else the record's first RDMA
    NIC, else the seed's hardware."""
    nics = (replay or {}).get("topology", {}).get("nics") or []
    first = nics[0] if nics else {}
    src = []
    if nic_gbps is None and first.get("rate_gbps"):
        nic_gbps = first["rate_gbps"] / 8
        src.append(f"the record's {first['name']}")
    if members is None and first:
        members = len(first.get("slaves") or ()) or 1
    if nic_gbps is None or members is None:
        src.append("the seed's ConnectX-8 (2 x 400GbE; --nic-gbps / --bond-members change it)")
    return (DEFAULT_NIC_GBPS if nic_gbps is None else nic_gbps,
            DEFAULT_MEMBERS if members is None else members, "; ".join(src) or "the flags")


def _reason(what: str) -> str:
    head = re.split(r" on \S+ \(| \(|; |: (?=[a-z])", what, maxsplit=1)[0]
    return head if len(head) <= 90 else head[:87] + "..."


def settings(findings: list[dict]) -> list[str]:
    """The hints of the warnings and errors, each setting once (a hint that starts with VAR=VALUE
    is keyed by it), with the problems it answers."""
    keyed = {}
    for f in findings:
        if f["level"] == "info" or f["hint"].startswith("read it with the QoS findings"):
            continue
        m = _SETTING.match(f["hint"])
        key = m.group(0) if m else f["hint"]
        hint, reasons = keyed.setdefault(key, (f["hint"], []))
        if _reason(f["what"]) not in reasons:
            reasons.append(_reason(f["what"]))
    return [f"  {hint}  [for: {'; '.join(reasons)}]" for hint, reasons in keyed.values()]


def evidence(replay: dict | None, stack: str) -> dict:
    """{gap kind: what the record shows of it} for explain.format_explain."""
    if replay is None:
        return {}
    spread = [f for f in replay["findings"] if f["what"].startswith("the bond is not spreading")]
    bond = (f"{len(spread)} bond(s) not spreading (section 2)" if spread else
            "every member carried at least a third of its bond's bytes: not this here"
            if replay["members"] else "no member byte counters: unknown")
    lands = [r for n in replay["qos"]["nics"] for r in n.get("stacks") or []
             if r["stack"] == stack]
    lossy = sorted({r["priority"] for r in lands if r["lossless"] is False})
    moved = [f["what"].split(" moved")[0] for f in replay["counters"] if " moved in " in f["what"]]
    qos = ((f"{stack}'s traffic lands on priority {', '.join(map(str, lossy))} without PFC "
            "(section 3)" if lossy else f"{stack}'s traffic lands on a lossless priority"
            if lands else f"{stack}'s priority unknown")
           + (f"; moved: {', '.join(moved)} (section 4)" if moved else "; no loss counter moved"))
    return dict(bond=bond, qos=qos)


def tell(explained: dict | None, replay: dict | None) -> str:
    """The five sections (module docstring) as text."""
    out = ["1. What the printed figures mean"]
    out += ([f"  {x}" for x in explain.format_explain(
        explained, evidence(replay, explained["stack"]))] if explained else
            ["  no printout given (--explain FILE)"])
    if replay is None:
        out += ["2. Bytes per bond member", "3. The priority each stack's traffic lands on",
                "4. The counters that moved", "5. The settings to change",
                "  sections 2-5 need a record of a node: python -m jaxep.doctor --record DIR "
                "there while the job runs, then add --replay DIR here"]
        return "\n".join(out)
    spread = [f for f in replay["findings"] if f["what"].startswith("the bond is not spreading")]
    out.append(f"2. Bytes per bond member (record {replay['record']})")
    out += record.member_lines(replay) or ["  no bonded NIC in the record"]
    shown = [bond.shares_text(rows) + "; " for rows in replay["members"].values()]
    for f in spread:  # its shares are on the member line above: the rest of it, once
        what = f["what"]
        for text in shown:
            what = what.replace(text, "")
        out.append(f"  {what}")
    if replay["members"] and not spread:
        out.append("  every member carried at least a third of its bond's bytes: the bonds "
                   "spread their queue pairs")
    out.append("3. The priority each stack's traffic lands on")
    out += stacks.grouped_lines(replay["qos"]["nics"]) or [
        "  no RoCE NIC in the record: no priority to follow"]
    out.append("4. The counters that moved")
    out += [f"  {f['what']}" for f in replay["counters"]] or ["  none in the record's interval"]
    out.append("5. The settings to change")
    out += settings(replay["findings"]) or ["  none"]
    return "\n".join(out)
