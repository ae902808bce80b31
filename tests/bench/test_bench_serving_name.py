"""bench/bench_serving_check.py runs sglang's serving benchmark under its 0.5.23 name."""

import importlib.util
import sys

from bench_harness import ROOT

sys.path.insert(0, str(ROOT / "bench"))


def test_the_check_runs_the_serving_benchmark_the_installed_sglang_names_current():
    import bench_serving_check

    assert importlib.util.find_spec(bench_serving_check.SERVING_MODULE) is not None
    # The old name is only sglang's deprecation shim, forwarding to the module the check runs.
    old = importlib.util.find_spec("sglang.bench_serving")
    if old is not None:
        text = open(old.origin).read()
        assert "deprecated" in text and bench_serving_check.SERVING_MODULE in text
