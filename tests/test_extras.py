"""CPU tier: the tools apart from the library. The library (`import jaxep`, an op on the reference
backend, `import jaxep.nn`) imports none of the tools nor their dependencies (the extras of
pyproject.toml); each tool run without its extra exits at once with one line naming the extra."""
import json
import os
import runpy
import subprocess
import sys
import textwrap

import pytest

from jaxep import _extras

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL_DEPS = ("absl", "rich", "psutil", "matplotlib")
TOOLS = ("jaxep.bench", "jaxep.doctor", "jaxep.launch")

PROBE = textwrap.dedent("""
    import json, sys

    DEPS, TOOLS = {deps!r}, {tools!r}

    def tooling(names):
        return sorted(m for m in names
                      if m.split(".")[0] in DEPS or m.startswith(tuple(t + "." for t in TOOLS))
                      or m in TOOLS)

    out = {{}}
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    before = set(sys.modules)
    import jaxep
    out["import jaxep"] = tooling(set(sys.modules) - before)

    cfg = jaxep.Config(num_experts=4, topk=2, hidden=8, max_tokens_per_rank=4, dtype="float32")
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))

    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend="reference")
        return jaxep.combine(res.x, res.handle, axis_name="ep")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    x = jnp.ones((4, 8), jnp.float32)
    idx = jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]], jnp.int32)
    y = f(x, idx, jnp.full((4, 2), 0.5, jnp.float32))
    out["combine"] = float(y.sum())
    out["an op on the reference backend"] = tooling(set(sys.modules) - before)

    from flax import nnx  # flax imports absl and rich itself: only what jaxep.nn adds counts
    before_nn = set(sys.modules)
    import jaxep.nn
    out["import jaxep.nn"] = tooling(set(sys.modules) - before_nn)
    out["tools anywhere"] = [m for m in tooling(sys.modules) if m.split(".")[0] == "jaxep"]

    # The runtime imports the doctor's topology to word a multi-host failure: stdlib only.
    before_topo = set(sys.modules)
    import jaxep.topology
    out["import jaxep.topology"] = [
        m for m in tooling(set(sys.modules) - before_topo) if m.split(".")[0] in DEPS]
    print(json.dumps(out))
""")


def test_the_library_imports_no_tool_and_no_tool_dependency():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-c", PROBE.format(deps=TOOL_DEPS, tools=TOOLS)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out.pop("combine") == 32.0  # every token's rows back, weights 0.5 + 0.5
    assert out == {"import jaxep": [], "an op on the reference backend": [],
                   "import jaxep.nn": [], "tools anywhere": [],
                   "import jaxep.topology": []}, out


def _one_line(exc) -> str:
    text = exc.value.code
    assert isinstance(text, str) and "\n" not in text, text
    return text


@pytest.mark.parametrize("module", ["absl", "rich"])
def test_bench_without_its_extra_names_it(monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    monkeypatch.setattr(sys, "argv", ["jaxep-bench", "--tokens", "1"])
    import jaxep.bench  # pylint: disable=import-outside-toplevel
    with pytest.raises(SystemExit) as e:
        jaxep.bench.console_main()
    text = _one_line(e)
    assert text.startswith(f"jaxep-bench needs {module}") and "pip install 'jaxep[bench]'" in text


def test_bench_plot_without_matplotlib_names_the_extra_before_running(tmp_path):
    """--plot asks for matplotlib before any work (no benchmark is run)."""
    code = ("import sys; sys.modules['matplotlib'] = None; "
            "from jaxep.bench import runner; runner.run = lambda *a, **k: sys.exit('ran'); "
            "from jaxep.bench import console_main; console_main()")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-c", code, "--plot", str(tmp_path / "p.png")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert p.stderr.strip() == ("jaxep-bench needs matplotlib, which is not installed: "
                                "pip install 'jaxep[bench]'"), p.stderr


@pytest.mark.parametrize("tool", ["doctor", "launch"])
def test_doctor_and_launcher_without_psutil_name_their_extra(monkeypatch, capsys, tool):
    monkeypatch.setitem(sys.modules, "psutil", None)
    monkeypatch.setattr(sys, "argv", [f"jaxep.{tool}", "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(f"jaxep.{tool}", run_name="__main__", alter_sys=False)
    text = _one_line(e)
    assert text == (f"python -m jaxep.{tool} needs psutil, which is not installed: "
                    f"pip install 'jaxep[{tool}]'")
    assert capsys.readouterr().out == ""  # stopped before any work, --help included


def test_every_extra_names_modules_its_pyproject_extra_installs():
    """The modules each tool checks come from the distributions of its pyproject.toml extra."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        pp = tomllib.load(f)
    extras = pp["project"]["optional-dependencies"]
    dist = {"absl": "absl-py", "rich": "rich", "psutil": "psutil", "matplotlib": "matplotlib",
            "flax": "flax"}
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0] for r in reqs}
    for extra, (_, modules) in _extras.EXTRAS.items():
        assert {dist[m] for m in modules} <= names(extras[extra]), extra
        assert {dist[m] for m in modules} <= names(extras["test"]), extra
    assert "matplotlib" in names(extras["bench"])
    assert not {"absl-py", "rich", "psutil", "matplotlib"} & names(pp["project"]["dependencies"])
