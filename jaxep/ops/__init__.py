"""The two ops, one module each: dispatch.py and combine.py."""
from jaxep.ops.combine import combine
from jaxep.ops.dispatch import dispatch

__all__ = ["dispatch", "combine"]
