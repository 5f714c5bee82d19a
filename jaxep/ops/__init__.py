"""The ops, one module each: dispatch.py and combine.py; the low-latency split halves in
dispatch_ll.py and combine_ll.py."""
from jaxep.ops.combine import combine
from jaxep.ops.combine_ll import combine_recv, combine_send
from jaxep.ops.dispatch import dispatch
from jaxep.ops.dispatch_ll import dispatch_recv, dispatch_send

__all__ = ["dispatch", "combine", "dispatch_send", "dispatch_recv", "combine_send", "combine_recv"]
