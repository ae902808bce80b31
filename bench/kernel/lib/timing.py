"""How bench/kernel/microbench times a decode call on a CUDA device, and what it records.

Three times per call, each from ``k`` calls on ``k`` distinct input sets (so no call finds
another's KV in L2), repeated, and summarised as median and spread:

- GPU (``graph``): the ``k`` calls captured in one CUDA graph, as sglang's decode runs them.
  Per sample: a sleep kernel gives the host a head start, L2 is flushed (a read of a buffer of
  twice the L2 size), then events bracket one replay. Both the sleep and the flush are outside
  the events.
- eager: L2 flushed, the device synchronised, then events around ``k`` eager calls: what a
  caller without graphs waits for, host launch path included.
- host: wall clock around ``k`` eager calls enqueued while the device runs a sleep kernel long
  enough that the queue never waits on it; a sample where the sleep had already ended when the
  enqueues returned is counted as ``host_blocked`` (the call waited for the device, or the head
  start was too short).

Also here: the launch recorder (each Triton launch's kernel, grid and warps during one probe
call) and the split log (the split count the kernels log through ``*.sm120_mma_splits``).
"""

import logging
import re
import statistics
import time

# Logger names of the split choice: the kernel's, and the baseline's (bench/kernel/lib/gpu_kit).
SPLIT_LOGGERS = (
    "sglang.kernels.ops.attention.sm120_mma_splits",
    "sm120pd_baseline.sm120_mma_splits",
)
_SPLITS = re.compile(r"-> (\d+) splits")
# The stream-K kernel's choice is a CTA count (the split-K kernel's line names its CTAs after
# its splits: "-> 8 splits, 512 CTAs").
_CTAS = re.compile(r"-> (\d+) CTAs")
# Head start (sleep) before a graph sample: covers enqueueing the flush, the events and the
# replay, so the device never waits on the host inside the events.
GRAPH_HEAD_START_US = 200.0


def summarize(samples: list[float]) -> dict:
    """Median, quartiles, min and max of per-call microseconds."""
    ordered = sorted(samples)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {
        "median": round(statistics.median(ordered), 3),
        "min": round(ordered[0], 3),
        "max": round(ordered[-1], 3),
        "q1": round(q1, 3),
        "q3": round(q3, 3),
        "n": len(ordered),
    }


class Timer:
    """The device's clock helpers: L2 flush, sleep calibrated in microseconds, events."""

    def __init__(self, torch, device):
        self.torch = torch
        props = torch.cuda.get_device_properties(device)
        self.l2_bytes = int(props.L2_cache_size)
        self.flush_bytes = max(2 * self.l2_bytes, 1 << 20)
        self._flush_buffer = torch.zeros(self.flush_bytes // 4, dtype=torch.float32, device=device)
        self.cycles_per_us = self._calibrate_sleep()
        # One side stream for every capture's warm-up: kernels may keep scratch per stream.
        self._side = torch.cuda.Stream(device)

    def describe(self) -> dict:
        return {
            "l2_bytes": self.l2_bytes,
            "l2_flush": (
                f"a read (torch.sum) of a {self.flush_bytes / 2**20:.0f} MiB buffer, twice the "
                "L2, before every graph sample and every eager sample, outside the events"
            ),
            "sleep_cycles_per_us": round(self.cycles_per_us, 1),
        }

    def _calibrate_sleep(self) -> float:
        torch = self.torch
        torch.cuda._sleep(1000)
        start, end = self.events()
        cycles = 5_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) * 1e3)

    def events(self):
        event = self.torch.cuda.Event
        return event(enable_timing=True), event(enable_timing=True)

    def flush(self) -> None:
        self._flush_buffer.sum()

    def sleep_us(self, us: float) -> None:
        self.torch.cuda._sleep(max(1, int(us * self.cycles_per_us)))

    def capture(self, calls: list):
        """A CUDA graph of ``calls`` (warmed on a side stream first, as capture requires),
        replayed once untimed (the first replay uploads the graph)."""
        torch = self.torch
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(self._side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        graph.replay()
        torch.cuda.synchronize()
        return graph

    def graph_sample(self, graph, calls_in_graph: int) -> float:
        """Microseconds per call of one replay, L2 cold."""
        start, end = self.events()
        self.sleep_us(GRAPH_HEAD_START_US)
        self.flush()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / calls_in_graph

    def eager_sample(self, calls: list) -> float:
        """Microseconds per call between events around eager calls started on an idle device."""
        start, end = self.events()
        self.flush()
        self.torch.cuda.synchronize()
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / len(calls)

    def host_sample(self, calls: list, head_start_us: float) -> tuple[float, bool]:
        """(host microseconds per call to enqueue, whether the enqueues waited on the device)."""
        torch = self.torch
        torch.cuda.synchronize()
        slept = torch.cuda.Event()
        self.sleep_us(head_start_us)
        slept.record()
        began = time.perf_counter()
        for call in calls:
            call()
        took = time.perf_counter() - began
        blocked = slept.query()
        torch.cuda.synchronize()
        return took * 1e6 / len(calls), blocked


class LaunchRecorder:
    """Records the kernel, grid and warps of each Triton launch while ``recording`` is set.

    It wraps the active Triton driver's ``launcher_cls`` (called once per compiled kernel when
    its handles are made; the object it returns is called for every launch), so it sees every
    Triton kernel loaded after ``install``: the kernels of every backend, whichever way their
    launcher calls Triton. A launch pays one Python call more for it (the same for every Triton
    backend).
    """

    def __init__(self):
        self.recording = False
        self.launches: list[dict] = []

    def install(self, driver) -> None:
        real = driver.launcher_cls

        def recorded(src, metadata):
            return _RecordedLauncher(self, real(src, metadata), metadata)

        driver.launcher_cls = recorded

    def __enter__(self):
        self.launches = []
        self.recording = True
        return self

    def __exit__(self, *exc):
        self.recording = False


class _RecordedLauncher:
    def __init__(self, recorder: LaunchRecorder, inner, metadata):
        self._recorder = recorder
        self._inner = inner
        self._name = metadata.name
        self._warps = metadata.num_warps

    def __call__(self, grid_x, grid_y, grid_z, stream, function, *args):
        if self._recorder.recording:
            self._recorder.launches.append(
                {"kernel": self._name, "grid": [grid_x, grid_y, grid_z], "warps": self._warps}
            )
        return self._inner(grid_x, grid_y, grid_z, stream, function, *args)


class SplitLog(logging.Handler):
    """Collects what the kernels' split choice logs (once per new shape and knob value)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        for name in SPLIT_LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(logging.INFO)
            logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def close(self) -> None:
        for name in SPLIT_LOGGERS:
            logging.getLogger(name).removeHandler(self)
        super().close()

    def take_splits(self) -> int | None:
        """The split count of the last message since the previous call, if one was logged."""
        return self.take_choice()[0]

    def take_choice(self) -> tuple[int | None, int | None]:
        """(split count, CTA count) of the last message since the previous call: a split-K
        kernel logs its splits, the stream-K kernel its CTAs; None where nothing says."""
        splits = [int(m.group(1)) for m in map(_SPLITS.search, self.messages) if m]
        ctas = [int(m.group(1)) for m in map(_CTAS.search, self.messages) if m]
        self.messages = []
        return (splits[-1] if splits else None, ctas[-1] if ctas else None)
