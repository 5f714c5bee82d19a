"""CPU tier: the private JAX attributes of jaxep/_jax_private.py are where it looks for them, and
when JAX moves one the error names it."""
import jax
import pytest
from jax._src import distributed

from jaxep import _jax_private


def test_every_private_attribute_resolves_in_this_jax():
    # Fails, naming the attribute, on a JAX that moved one: update jaxep/_jax_private.py then.
    assert _jax_private.missing() == [], (
        f"jax {jax.__version__} lacks {_jax_private.missing()}: see jaxep/_jax_private.py")


def test_distributed_client_is_none_without_jax_distributed():
    assert not jax.distributed.is_initialized()
    assert _jax_private.distributed_client() is None


def test_distributed_client_reads_the_attribute_when_called(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(distributed.global_state, "client", sentinel)
    assert _jax_private.distributed_client() is sentinel
    assert jax.distributed.is_initialized()  # the public question agrees with the private answer


def test_coordinator_address_is_read_when_called(monkeypatch):
    assert _jax_private.coordinator_address() is None  # jax.distributed not initialized
    monkeypatch.setattr(distributed.global_state, "coordinator_address", "node0:29500")
    assert _jax_private.coordinator_address() == "node0:29500"


def test_a_moved_attribute_is_named(monkeypatch):
    monkeypatch.delattr(distributed, "global_state")
    with pytest.raises(_jax_private.JaxPrivateMoved,
                       match=r"jax\._src\.distributed\.global_state\.client.*jax\._src\.distributed "
                             r"has no attribute 'global_state' in jax \d"):
        _jax_private.distributed_client()
    assert _jax_private.missing() == ["jax._src.distributed.global_state.client",
                                      "jax._src.distributed.global_state.coordinator_address"]


def test_a_moved_module_is_named():
    with pytest.raises(_jax_private.JaxPrivateMoved, match=r"jax\._src\.no_such_module\.x"):
        _jax_private.resolve("jax._src.no_such_module.x")
    with pytest.raises(_jax_private.JaxPrivateMoved, match="no module of it imports"):
        _jax_private.resolve("no_such_top_level_pkg.x")
