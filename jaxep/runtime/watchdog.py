"""Timeouts of the multi-rank kernels: the text of the diagnostic record a kernel writes when a
bounded wait expires, and a watchdog thread that logs it.

A kernel that times out records rank, op, phase, peer and the flag values in host-mapped memory
and exits (no trap); `text` turns that record into the message `jaxep.check()` raises.
"""
from __future__ import annotations

import builtins
import logging
import threading

from jaxep import _extension

log = logging.getLogger("jaxep")


class TimeoutError(builtins.TimeoutError):  # pylint: disable=redefined-builtin
    """A multi-rank kernel's bounded wait expired (a peer died, hung, or runs another program).

    The message names the rank, the op, the phase, the peer and the flag values. After it, the
    runtime is aborted: every later multi-rank kernel of this process returns at once (outputs
    unspecified) until `jaxep.finalize()`.
    """


# What each wait phase of a multi-rank call means, keyed by the short names the extension gives
# its phase codes (`jaxep._extension.constants()["phases"]`).
_PHASE_TEXT = {
    "none": "-",
    "free": "release (waiting for the peer to finish reading this rank's stage of the previous call)",
    "ready": "exchange (waiting for the peer's stage of this call)",
    "zero_copy": "zero-copy release (waiting for the peer to finish reading this rank's x or y of "
                 "this call in its XLA pool)",
    # Internode (ffi/cuda/internode.h): the peer is the rank of another node with this local index.
    "credit": "internode credit (waiting for the peer's node to free the region the peer hosts "
              "for this rank)",
    "remote_meta": "internode metadata (waiting for the peer's metadata put of this call)",
    "remote_rows": "internode rows (the pull of the other nodes' sources waiting for one row the "
                   "peer puts into its forwarder on this node, the rank with the peer's local "
                   "index: flag = the row's last call seq)",
    "return": "internode return (waiting for the peer's node's partials / values for this rank's "
              "tokens: flag = results arrived (gather_back), or the last call seq of one chunk of "
              "8 tokens' partials (combine))",
    # Low-latency kernels (ffi/cuda/low_latency.h): flag and want are the op's device seq.
    "ll_counts": "low-latency dispatch counts (waiting for the source's counts message of this "
                 "call)",
    "ll_row": "low-latency dispatch row (waiting for one row the source writes into this rank's "
              "receive area)",
    "ll_combine_row": "low-latency combine row (waiting for one of this rank's slots to come back "
                      "from the expert's rank)",
    "ll_combine_start": "low-latency combine start (waiting for the peer to begin this call's "
                        "combine_send, i.e. to finish reading its last combine)",
}


def text(record: dict | None, timeout_s: float, node_size: int) -> str | None:
    """The message of a kernel's diagnostic record (`runtime_diag()`), or None when there is none."""
    if record is None:
        return None
    names = _extension.constants() or {}
    op = names.get("ops", {}).get(record["op"], record["op"])
    phase = names.get("phases", {}).get(record["phase"], record["phase"])
    g = node_size or 1
    where = lambda r: f"rank {r} (node {r // g}, local {r % g})"  # noqa: E731
    return (f"jaxep: {where(record['rank'])} timed out in {op} (call #{record['seq']}), "
            f"phase {_PHASE_TEXT.get(phase, phase)}, waiting for peer {where(record['peer'])}: "
            f"flag {record['seen']}, want {record['awaited']} (waited "
            f"{record['waited_ns'] / 1e9:.1f} s, timeout {timeout_s:g} s). The peer process died, "
            "hangs, or runs a different sequence of jaxep calls; this process's multi-rank "
            "kernels are aborted until jaxep.finalize()")


class Watchdog:
    """A daemon thread that polls `diagnostic` every 0.5 s and logs its first text at ERROR."""

    def __init__(self, diagnostic):
        self._stop = threading.Event()
        self.reported = False

        def poll():
            while not self._stop.wait(0.5):
                found = diagnostic()
                if found and not self.reported:
                    self.reported = True
                    log.error("%s", found)
                    return

        self.thread = threading.Thread(target=poll, name="jaxep-watchdog", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
