"""Test setup: 8 emulated host devices for the CPU tier (set before jax is imported)."""
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
