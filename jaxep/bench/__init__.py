"""jaxep-bench: where the time of EP dispatch/combine goes (docs/benchmark.md).

    from jaxep.bench import BenchConfig, run
    result = run(BenchConfig(tokens=256, hidden=512, topk=4, experts=16))

`jaxep.bench.accounting` (byte accounting) needs only NumPy. Command-line flags live in
`jaxep.bench.cli` and are defined only when the command line is used; the command line needs the
[bench] extra (absl-py, rich; matplotlib for --plot) and says so when it is missing.
"""


def run(bench_config, emit=print, progress=None):
    """See `jaxep.bench.runner.run`."""
    from jaxep.bench import runner
    return runner.run(bench_config, emit=emit, progress=progress)


def __getattr__(name):
    if name == "BenchConfig":
        from jaxep.bench.runner import BenchConfig
        return BenchConfig
    raise AttributeError(name)


def console_main():
    """Entry point of the `jaxep-bench` console script and `python -m jaxep.bench`."""
    from jaxep import _extras
    _extras.require("bench")
    from jaxep.bench import cli
    cli.console_main()
