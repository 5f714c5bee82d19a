"""CPU tier: the doctor runs on a machine without GPU, NVSHMEM build or NICs, and says so."""
import json

from jaxep import doctor

KEYS = {"python", "os", "machine", "packages", "jax", "nvidia_smi", "nvshmem", "extension",
        "infiniband", "gpu_nic_affinity", "mps", "env", "problems"}


def test_facts_keys_and_json():
    f = doctor.facts()
    assert set(f) == KEYS
    json.dumps(f, default=str)
    assert f["jax"]["default_backend"] == "cpu"
    assert {"found"} <= set(f["nvshmem"]) and {"available", "gpus"} <= set(f["nvidia_smi"])
    for p in f["problems"]:
        assert set(p) == {"level", "what", "hint"} and p["level"] in ("info", "warn", "error")


def test_report_and_main(capsys):
    assert doctor.main([]) in (0, 1)
    out = capsys.readouterr().out
    assert "NVSHMEM" in out and "problems" in out and "XLA_FLAGS" in out


def test_affinity_without_sysfs():
    rows = doctor.gpu_nic_affinity([{"index": "0", "pci_bus_id": "00000000:18:00.0"}], [])
    assert rows[0]["nearest_nic"] is None
