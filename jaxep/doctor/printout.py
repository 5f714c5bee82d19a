"""The summary lines of another EP stack's own internode test, read line by line:
`parse(text)` -> {format, printed, figures, known, unknown}. Every line is either one of the
formats below or reported in `unknown` with its number; nothing is guessed from a line the parser
does not know. Stdlib only.

The formats are those of the tests' printing code, read there (no run of either was parsed):
- DeepEP's internode test (deepseek-ai/DeepEP:tests/test_internode.py, v1.2.1; the same printer
  is DeepEP:tests/legacy/test_internode.py on main, b306af0): "[config] num_tokens=T, hidden=H,
  num_topk_groups=G, num_topk=K"; "[tuning] SMs S, NVL chunk C, RDMA chunk R: N + t us, X GB/s (RDMA), Y GB/s (NVL)"
  for each candidate; "[tuning] Best dispatch (BF16|FP8): ...: N + t us, X GB/s (RDMA), Y GB/s
  (NVL)" and "[tuning] Best combine: ..., N + t us, X GB/s (RDMA), Y GB/s (NVL)"; t excludes the
  notify kernel's N. Printed by each node's local rank 0; the test asserts 8 ranks per node and
  does not print the expert count, the ranks or the nodes.
- HybridEP's test (deepseek-ai/DeepEP's hybrid-ep branch, DeepEP:tests/test_hybrid_ep.py at
  94a9f8f):
  "=== Torch API Benchmark (BF16, 16 ranks) ===" headers, then per API "<label>: X GB/s (NVL|RDMA),
  t: T us [min=a, max=b], <bytes name>: B MB" (rank 0, the time averaged over the ranks), and under
  "=== Kernel Benchmark ... ===" "<label>(NVL|RDMA): X GB/s, avg_t=T us [min=a, max=b]". Its
  parameters come from environment variables it does not print (NUM_TOKENS_PER_RANK=4096,
  HIDDEN_DIM=7168, TOPK=8, NUM_LOCAL_EXPERTS=8 by default) and --num-processes (ranks per node).
  Its earlier printer (same file at 5eb0722) wrote each rank's "[rank R] HybridEP <label>: X GB/s
  (NVL|IB), t: T us, <bytes name>: B MB" and "[rank R] HybridEP dispatch kernel(NVL) (BF16): X GB/s,
  avg_t=T us | HybridEP combine kernel(NVL): X GB/s, avg_t=T us"; rank 0's lines are read.
"""
from __future__ import annotations

import dataclasses
import re

DEEPEP = "DeepEP's internode test (DeepEP:tests/test_internode.py)"
HYBRIDEP = "HybridEP's test (DeepEP:tests/test_hybrid_ep.py, hybrid-ep branch)"
_NUM = r"([\d.]+)"


@dataclasses.dataclass(frozen=True)
class Figure:
    """One printed GB/s: op "dispatch" | "combine", link "NVL" | "RDMA" (HybridEP's "IB" is its
    RDMA), the time it divides by, the bytes it printed (MB; None where not printed), dtype."""
    line: int
    label: str
    op: str
    link: str
    gbps: float
    time_s: float
    printed_mb: float | None
    dtype: str


_DEEPEP_CONFIG = re.compile(r"\[config\] num_tokens=(\d+), hidden=(\d+), num_topk_groups=(\d+), "
                            r"num_topk=(\d+)")
_DEEPEP_BEST = re.compile(r"\[tuning\] Best (dispatch|combine)(?: \((BF16|FP8)\))?: SMs \d+, NVL "
                          rf"chunk \d+, RDMA chunk \d+[:,] {_NUM} \+ {_NUM} us, {_NUM} GB/s "
                          rf"\(RDMA\), {_NUM} GB/s \(NVL\)\s*")
_DEEPEP_KNOWN = re.compile(r"\[tuning\] SMs \d+, NVL chunk \d+, RDMA chunk \d+: [\d.]+ \+ [\d.]+ "
                           r"us, [\d.]+ GB/s \(RDMA\), [\d.]+ GB/s \(NVL\)\s*"
                           r"|\[layout\] Kernel performance: [\d.]+ ms"
                           r"|\[testing\] Running with (FP8|BF16), with(out)? top-k \(async=\w+, "
                           r"previous=\w+\) \.\.\.( passed)?|\s*passed"
                           r"|Testing with seed \d+ \.\.\.|ref_hash=-?\d+")
_HYBRID_HEADER = re.compile(r"=== (Correctness Check|Torch API Benchmark|Kernel Benchmark) "
                            r"\((BF16|FP8), (\d+) ranks\) ===")
_HYBRID_API = re.compile(rf"(?P<label>[\w+ ()]+?):\s+{_NUM} GB/s \((NVL|RDMA)\), t: {_NUM} us "
                         rf"\[min={_NUM}, max={_NUM}\], (\w+): {_NUM} MB")
_HYBRID_KERNEL = re.compile(rf"(?P<label>[\w+ ()]+?)\((NVL|RDMA)\):\s+{_NUM} GB/s, avg_t={_NUM} us "
                            rf"\[min={_NUM}, max={_NUM}\]")
_HYBRID_KNOWN = re.compile(r"\s+(Non-permute|Permute|Fused|Non-fused):.*|\s+combine\s+=.*"
                           r"|\s+\(misc = .*\)|\s+.+: PASS|profile hybrid-ep .*")
_HYBRID_OLD = re.compile(rf"\[rank (\d+)\] HybridEP (?P<label>.+?): {_NUM} GB/s \((NVL|IB)\), t: "
                         rf"{_NUM} us, (\w+): {_NUM} MB")
_HYBRID_OLD_KERNEL = re.compile(rf"\[rank (\d+)\] HybridEP dispatch kernel\((NVL|IB)\) "
                                rf"\((BF16|FP8)\): {_NUM} GB/s, avg_t={_NUM} us \| HybridEP "
                                rf"combine kernel\((?:NVL|IB)\): {_NUM} GB/s, avg_t={_NUM} us")
_HYBRID_OLD_KNOWN = re.compile(r"\[rank \d+\] Correctness check passed \((BF16|FP8)\)")


def _op(label: str) -> str:
    return "combine" if "combine" in label else "dispatch"


def _dtype(label: str, default: str) -> str:
    m = re.search(r"\((BF16|FP8)\)", label)
    return m.group(1) if m else default


class _State:
    def __init__(self):
        self.fmt, self.printed, self.figures = set(), {}, []
        self.known, self.unknown, self.dtype, self.other_ranks = 0, [], "BF16", 0

    def add(self, fmt, fig=None):
        self.fmt.add(fmt)
        self.known += 1
        if fig is not None:
            self.figures.append(fig)


def _deepep(s: _State, n: int, line: str) -> bool:
    m = _DEEPEP_CONFIG.fullmatch(line)
    if m:
        s.printed.update(tokens=int(m.group(1)), hidden=int(m.group(2)), topk=int(m.group(4)))
        s.add(DEEPEP)
        return True
    m = _DEEPEP_BEST.fullmatch(line)
    if m:
        op, dtype = m.group(1), m.group(2) or "BF16"
        t = float(m.group(4)) * 1e-6
        label = f"Best {op}" + (f" ({dtype})" if m.group(2) else "")
        s.add(DEEPEP, Figure(n, label, op, "RDMA", float(m.group(5)), t, None, dtype))
        s.figures.append(Figure(n, label, op, "NVL", float(m.group(6)), t, None, dtype))
        return True
    if _DEEPEP_KNOWN.fullmatch(line):
        s.add(DEEPEP)
        return True
    return False


def _hybrid(s: _State, n: int, line: str) -> bool:
    m = _HYBRID_HEADER.fullmatch(line)
    if m:
        s.dtype = m.group(2)
        s.printed["ranks"] = int(m.group(3))
        s.add(HYBRIDEP)
        return True
    m = _HYBRID_API.fullmatch(line)
    if m:
        label = m.group("label").strip()
        s.add(HYBRIDEP, Figure(n, label, _op(label), m.group(3), float(m.group(2)),
                               float(m.group(4)) * 1e-6, float(m.group(8)),
                               _dtype(label, s.dtype)))
        return True
    m = _HYBRID_KERNEL.fullmatch(line)
    if m:
        label = m.group("label").strip()
        s.add(HYBRIDEP, Figure(n, f"{label} kernel" if "kernel" not in label else label,
                               _op(label), m.group(2), float(m.group(3)),
                               float(m.group(4)) * 1e-6, None, _dtype(label, s.dtype)))
        return True
    if _hybrid_old(s, n, line):
        return True
    if _HYBRID_KNOWN.fullmatch(line):
        s.add(HYBRIDEP)
        return True
    return False


def _hybrid_old(s: _State, n: int, line: str) -> bool:
    m = _HYBRID_OLD.fullmatch(line)
    if m:
        label = m.group("label")
        fig = Figure(n, label, _op(label), "RDMA" if m.group(4) == "IB" else "NVL",
                     float(m.group(3)), float(m.group(5)) * 1e-6, float(m.group(7)),
                     _dtype(label, "BF16"))
        s.add(HYBRIDEP, fig if m.group(1) == "0" else None)
        s.other_ranks += m.group(1) != "0"
        return True
    m = _HYBRID_OLD_KERNEL.fullmatch(line)
    if m:
        link = "RDMA" if m.group(2) == "IB" else "NVL"
        if m.group(1) == "0":
            s.figures.append(Figure(n, f"dispatch kernel ({m.group(3)})", "dispatch", link,
                                    float(m.group(4)), float(m.group(5)) * 1e-6, None, m.group(3)))
            s.figures.append(Figure(n, "combine kernel", "combine", link, float(m.group(6)),
                                    float(m.group(7)) * 1e-6, None, "BF16"))
        s.other_ranks += m.group(1) != "0"
        s.add(HYBRIDEP)
        return True
    if _HYBRID_OLD_KNOWN.fullmatch(line):
        s.add(HYBRIDEP)
        return True
    return False


def parse(text: str) -> dict:
    """{format, printed: {tokens, hidden, topk, ranks: as printed}, figures: [Figure], known:
    lines read, unknown: [(line number, text)], other_ranks: lines of ranks other than 0 (read,
    not explained)}. ValueError where the text mixes the two tests' formats."""
    s = _State()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not line.strip():
            continue
        if not (_deepep(s, n, line) or _hybrid(s, n, line)):
            s.unknown.append((n, line))
    if len(s.fmt) > 1:
        raise ValueError(f"--explain: the file mixes lines of {DEEPEP} and of {HYBRIDEP}: give one "
                         "test's printout")
    return dict(format=next(iter(s.fmt), None), printed=s.printed, figures=s.figures,
                known=s.known, unknown=s.unknown, other_ranks=s.other_ranks)
