"""`edgemoe.tools.profiler.summarize` on a hand-built timeline whose figures are worked out below (the GPU recording
itself runs in tests/gpu/test_side_stream.py)."""

from __future__ import annotations

import random

import pytest

from edgemoe.tools.profiler import GpuOp, ops_from_chrome_trace, summarize


def repeated(step: list[tuple], steps: int, period: int = 100, unit: int = 1) -> list[GpuOp]:
    """`steps` copies of one step's operations (name, stream, start, end, kernel), `period` apart, times in units
    of `unit` ns, sorted by start as `record` returns them."""
    ops = [
        GpuOp(name, stream, (i * period + a) * unit, (i * period + b) * unit, kernel)
        for i in range(steps)
        for name, stream, a, b, kernel in step
    ]
    return sorted(ops, key=lambda o: (o.start, o.end))


def timeline(steps: int, period: int = 100, unit: int = 1) -> list[GpuOp]:
    """Per step, main stream 7: A [0, 10), the miss copy [12, 20), C [21, 30); side stream 9: [13, 16), [18, 24)."""
    step = [
        ("gemv", 7, 0, 10, True),
        ("_copy_rows_0d1d", 7, 12, 20, True),
        ("memset", 7, 21, 30, False),
        ("shared_up", 9, 13, 16, True),
        ("shared_down", 9, 18, 24, True),
    ]
    return repeated(step, steps, period, unit)


def test_summarize_hand_worked_timeline() -> None:
    got = summarize(timeline(3), 3)
    assert got["kernels"] == 4 and got["ops"] == 5  # the memset is an op, not a kernel
    assert got["busy_us"] == pytest.approx(0.028)  # [0, 10) + [12, 30)
    assert got["gpu_us"] == pytest.approx(0.030)
    assert got["period_us"] == pytest.approx(0.1) and got["tok_s"] == pytest.approx(1e7)
    main, side = got["streams"]["7"], got["streams"]["9"]
    assert main["role"] == "main" and side["role"] == "other"
    assert main["ops_per_step"] == 3 and side["ops_per_step"] == 2
    assert main["gap_median_us"] == pytest.approx(0.0015)  # gaps 2 and 1 ns, three times
    assert main["gap_p90_us"] == pytest.approx(0.002)
    assert side["gap_median_us"] == pytest.approx(0.002)
    # eager-like: the copy runs on the busiest stream, so the parallel branch is stream 9: 3 + 6 ns per step, of
    # which 3 + 2 ns during the copy [12, 20)
    assert got["shared_us"] == pytest.approx(0.009)
    assert got["overlap"] == pytest.approx(5 / 9)
    # per name, by time per step: gemv and memset 10 and 9 ns, the copy 8 (its Triton suffix kept), shared 6 and 3
    assert [(t["name"], t["count"], t["us"]) for t in got["top"]] == [
        ("gemv", 1, pytest.approx(0.010)),
        ("memset", 1, pytest.approx(0.009)),
        ("_copy_rows_0d1d", 1, pytest.approx(0.008)),
        ("shared_down", 1, pytest.approx(0.006)),
        ("shared_up", 1, pytest.approx(0.003)),
    ]


def test_kernel_names_are_shortened() -> None:
    ops = []
    for i in range(2):
        ops += [
            GpuOp(
                "void at::native::vectorized_elementwise_kernel<4, Add>(int, Add, Array<char*, 3>)", 1, i, i + 1, True
            ),
            GpuOp(
                "void at::native::vectorized_elementwise_kernel<4, Mul>(int, Mul, Array<char*, 3>)", 1, i, i + 1, True
            ),
        ]
    (top,) = summarize(ops, 2)["top"]
    assert top["name"] == "void at::native::vectorized_elementwise_kernel" and top["count"] == 2


def test_summarize_is_order_free_and_counts_tokens() -> None:
    ops = timeline(4)
    random.Random(0).shuffle(ops)
    got = summarize(sorted(ops, key=lambda o: (o.start, o.end)), 4, tokens_per_step=4)
    assert got["tok_s"] == pytest.approx(4e7)


def test_summarize_without_a_side_stream_and_bad_splits() -> None:
    ops = [o for o in timeline(2) if o.stream == 7]
    got = summarize(ops, 2)
    assert "overlap" not in got and list(got["streams"]) == ["7"]
    with pytest.raises(ValueError, match="do not split"):
        summarize(ops[:-1], 2)
    with pytest.raises(ValueError, match="need >= 2 steps"):
        summarize(ops, 1)


def test_ops_from_chrome_trace_keeps_gpu_work_only() -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 10.5, "dur": 1.25, "args": {"stream": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 1},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "range", "ts": 9, "dur": 5, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 9.001, "dur": 0.5, "args": {"stream": 9}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 12, "dur": 1, "args": {"stream": 9, "bytes": 64}},
        {"ph": "f", "cat": "kernel", "name": "flow", "ts": 3},
    ]
    assert ops_from_chrome_trace(events) == [
        GpuOp("Memcpy HtoD", 9, 9001, 9501, False),
        GpuOp("k", 7, 10500, 11750, True),
        GpuOp("Memcpy HtoD", 9, 12000, 13000, False, 64),
    ]


def test_graph_like_timeline_finds_the_branch_beside_the_copy() -> None:
    """Graph replay: the routed branch (with the copy) moved to stream 20, the shared branch stayed on 7 between
    serial work: A ends before the branch window [11, 38) and C starts after it."""
    step = [("A", 7, 0, 10), ("S1", 7, 12, 15), ("S2", 7, 16, 18), ("C", 7, 40, 50)]
    step += [("R1", 20, 11, 14), ("_copy_rows", 20, 14, 30), ("R2", 20, 31, 38)]
    got = summarize(repeated([(*op, True) for op in step], 2), 2)
    assert got["streams"]["7"]["role"] == "main"
    assert got["shared_us"] == pytest.approx(0.005)  # S1 + S2
    assert got["overlap"] == pytest.approx(3 / 5)  # [14, 15) of S1 and all of S2


def test_top_ops_count_what_each_adds_to_its_stream() -> None:
    """PDL-like overlap: each kernel starts before the one before it ends and waits for it. Per step on stream 1:
    a [0, 10), b [8, 15) (adds 5), c [12, 14) (inside b: adds 0), a again [13, 20) (adds 5); stream 2: d [2, 6)
    (its own stream: adds 4)."""
    step = [("a", 1, 0, 10, True), ("b", 1, 8, 15, True), ("c", 1, 12, 14, True), ("a", 1, 13, 20, True)]
    got = {t["name"]: t for t in summarize(repeated([*step, ("d", 2, 2, 6, True)], 2), 2)["top"]}
    assert got["a"]["us"] == pytest.approx(0.017) and got["a"]["extends_us"] == pytest.approx(0.015)
    assert got["b"]["us"] == pytest.approx(0.007) and got["b"]["extends_us"] == pytest.approx(0.005)
    assert got["c"]["extends_us"] == 0 and got["d"]["extends_us"] == pytest.approx(0.004)
    # on each stream the parts add up to its span: 10 + 5 + 0 + 5 = 20 on stream 1
    assert sum(t["extends_us"] for n, t in got.items() if n != "d") == pytest.approx(0.020)


def test_steps_split_on_the_busiest_stream_while_the_copy_service_varies() -> None:
    """Offloaded graph replays: the copy service's memcpys (stream 5, not kernels) follow the misses, 2, 0 and 3 a
    step, and one of step 1's starts before step 2's first kernel: steps are cut on stream 7's kernels (a [0, 10),
    b [20, 30) each step, steps 100 apart), and the memcpys are neither a kernel nor a branch beside the experts."""
    copies = {0: [(11, 19), (19, 25)], 1: [(95, 105)], 2: [(11, 14), (14, 16), (16, 18)]}
    ops = []
    for i in range(3):
        t = 100 * i
        ops += [GpuOp("a", 7, t, t + 10, True), GpuOp("b", 7, t + 20, t + 30, True)]
        ops += [GpuOp("Memcpy HtoD (Pinned -> Device)", 5, t + a, t + b, False) for a, b in copies.get(i, [])]
    ops = sorted(ops, key=lambda o: (o.start, o.end))
    got = summarize(ops, 3)
    assert got["kernels"] == 2 and got["ops"] == 4  # per step 4, 3 (with step 1's late memcpy) and 5 operations
    assert got["period_us"] == pytest.approx(0.1)
    assert got["streams"]["7"]["role"] == "main" and got["streams"]["5"]["role"] == "other"
    assert got["streams"]["5"]["ops_per_step"] == 2  # 2, 1, 3
    assert "shared_us" not in got and "copy_lists" not in got  # no `ensure`: no copy list to place
    with pytest.raises(ValueError, match="do not split"):
        summarize(ops[1:], 3)


def test_copy_lists_hand_worked_timeline() -> None:
    """Offloaded graph replays, three layers a step (ns, steps 1000 apart), on stream 7: route, `_ensure` (it starts
    early under PDL), `_up`, `_down`. Layer 0 misses twice: memcpys [40, 140) and [150, 180) on stream 5; layer 1
    hits; layer 2 misses once, [400, 560), and runs its up and down in two passes each (as a variant that splits
    them would: the tails end at the second). Its ensure's inputs are ready at the route's end (10, 230, 320)."""
    step = [("route", 7, 0, 10), ("_ensure", 7, 5, 20), ("_up", 7, 12, 200), ("_down", 7, 190, 230)]
    step += [("route", 7, 230, 240), ("_ensure", 7, 235, 250), ("_up", 7, 245, 300), ("_down", 7, 300, 320)]
    step += [("route", 7, 320, 330), ("_ensure", 7, 325, 345), ("_up", 7, 340, 360), ("_down", 7, 350, 380)]
    step += [("_up", 7, 370, 590), ("_down", 7, 585, 640)]
    step += [("lm_head", 7, 640, 700)]
    memcpys = [(40, 140, 1000), (150, 180, 500), (400, 560, 2000)]
    ops = [GpuOp(n, s, 1000 * i + a, 1000 * i + b, True) for i in range(3) for n, s, a, b in step]
    ops += [GpuOp("Memcpy HtoD", 5, 1000 * i + a, 1000 * i + b, False, n) for i in range(3) for a, b, n in memcpys]
    got = summarize(sorted(ops, key=lambda o: (o.start, o.end)), 3)["copy_lists"]
    assert got["lists"] == 2  # layers 0 and 2
    assert got["first_byte_us"] == pytest.approx(0.050)  # 40 - 10 and 400 - 330
    assert got["first_byte_p90_us"] == pytest.approx(0.070)
    assert got["ensure_us"] == pytest.approx(0.0125)  # 20 - 10 and 345 - 330
    assert got["copies"] == 1.5 and got["gaps_us"] == pytest.approx(0.005)  # 2 copies with 10 idle, 1 with none
    assert got["tail_us"] == pytest.approx(0.065)  # 230 - 180 and 640 - 560
    assert got["up_tail_us"] == pytest.approx(0.025)  # 200 - 180 and 590 - 560
    assert got["link_busy_us"] == pytest.approx(0.290) and got["link_idle_us"] == pytest.approx(0.410)
    assert got["gbs"] == pytest.approx(3500 / 290)  # bytes per ns: GB/s
    from edgemoe.tools.measure import profile_lines

    us = [GpuOp(o.name, o.stream, 1000 * o.start, 1000 * o.end, o.kernel, o.nbytes) for o in ops]  # ns -> µs
    line = profile_lines(summarize(sorted(us, key=lambda o: (o.start, o.end)), 3))[1]
    assert line == (
        "    copy lists: 2 a step; first byte 50.0 us after the router (p90 70.0; ensure ends at 12.5); 1.5 copies a "
        "list, 5.0 us idle between them; 65.0 us from the last byte to down's end (25.0 to up's); link busy 290 us, "
        "idle 410 us a step, 0.0 GB/s while copying"
    )


def test_profile_lines_print_the_step_and_the_costliest_kernels() -> None:
    from edgemoe.tools.measure import profile_lines

    # times in µs: steps 100 µs apart, gaps of 2 and 1 µs on the main stream, gemv 10 µs a call
    got = profile_lines(summarize(timeline(3, unit=1000), 3))
    assert got[0] == "  profile: 100 us a step, 4 kernels, median gap 1.50 us on the main stream"
    assert profile_lines(summarize(timeline(2, 120, 1000), 2))[0].startswith("  profile: 120 us a step")
    assert got[1].split() == ["kernel", "calls", "us/call", "adds", "us/step"]
    assert got[2].split() == ["gemv", "1", "10.00", "10.0"]
    assert got[4].split() == ["_copy_rows_0d1d", "1", "8.00", "8.0"]  # starts 2 µs after gemv's end: adds all 8
    assert got[5].split() == ["shared_down", "1", "6.00", "6.0"]  # its own stream: [18, 24) after [13, 16)
    assert len(got) == 2 + 5 and profile_lines(None) == [] and profile_lines({}) == []
