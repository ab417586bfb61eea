"""The fused `ensure`'s post to the copy service (`edgemoe.kernels.miss_copy`'s row writers) under Triton's interpreter:
with the CPU split, each layer-step that copies something or leaves misses to the CPU posts one mailbox row holding
its copy list, the CPU's experts (`Ensured.cpu`), its routed ids and, when the CPU has pairs, its x rows as fp32 in
the service's `cpu_x`; a step that misses nothing posts nothing. The row is then served by the real C loop with the
fake driver of tests/offload/test_copy_service.py, so the kernel's row and the host's reading of it are checked
together: the CPU pairs' rows come out bitwise as `CpuExperts.compute` on the pairs whose slot is -1.

The interpreter has no inline assembly: the system-scope fence before the sequence number (a no-op for a program
that runs alone on the CPU) is made the identity here."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpreterBuilder  # noqa: E402

from edgemoe.kernels.ensure import ensure_fused  # noqa: E402
from edgemoe.kernels.protocol import HEADER, RING  # noqa: E402
from edgemoe.offload.copy_service import CopyService  # noqa: E402
from edgemoe.offload.cpu_experts import CpuExperts  # noqa: E402
from edgemoe.offload.cpu_split import manual_table  # noqa: E402
from edgemoe.offload.expert_cache import ExpertCache  # noqa: E402
from edgemoe.offload.layout import ExpertLayout  # noqa: E402
from tests.kernels import interpreter_only  # noqa: E402
from tests.offload.test_copy_service import HostGPU  # noqa: E402
from tests.offload.test_expert_cache import random_trace  # noqa: E402

pytestmark = [interpreter_only, pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]

L, E, S, TOKENS, TOP_K, H, INTER = 2, 8, 6, 2, 2, 32, 16


@pytest.fixture(autouse=True)
def fence_is_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    class Op:  # what `inline_asm_elementwise` reads of the op it builds
        def __init__(self, value) -> None:  # noqa: ANN001 - the interpreter's TensorHandle
            self.value = value

        def get_result(self, i: int):  # noqa: ANN202
            return self.value

    monkeypatch.setattr(InterpreterBuilder, "create_inline_asm", lambda self, asm, c, values, *rest: Op(values[0]))


class Served(HostGPU):
    """No GPU of its own: `serve` returns once every posted row is served."""

    def query(self, event: int) -> int:
        self.queries += 1
        return 600 if int(self.service.tick) > self.service.served else 0


def test_posted_rows_carry_the_cpu_pairs_and_x() -> None:
    g = torch.Generator().manual_seed(1)
    layout = ExpertLayout(H, INTER, torch.float32)
    banks_cpu = [torch.randn(E, layout.row, generator=g) * 0.3 for _ in range(L)]
    cache = ExpertCache(L, E, S, "lru", expert_bytes=4)
    pool = layout.empty(S + 1)
    cache.attach_pool(*layout.copy_views(pool), pool)
    cache.ensure_scratch = torch.zeros(S + 2 * E, dtype=torch.long)
    gpu = Served([])
    service = CopyService((cache.pool_a, cache.pool_b), cache.arrival_counters, 1, E, group=0, driver=gpu,
                          max_pairs=TOKENS * TOP_K)  # fmt: skip
    gpu.service = service
    table = torch.tensor(manual_table(1, E), dtype=torch.int32)  # one miss a layer-step on the CPU
    rows_seen = posts = 0
    with CpuExperts(1) as cpu_pool:
        service.attach_cpu(cpu_pool, [(b, layout, None) for b in banks_cpu], TOKENS)
        for step in random_trace(6, L, E, TOKENS, TOP_K, skew=1.0, seed=2):
            for layer, ids in enumerate(step):
                x = torch.randn(TOKENS, H, generator=g)
                copy_views = layout.copy_views(banks_cpu[layer])
                tick = int(service.tick)
                got = ensure_fused(cache, layer, ids, post=service.target(copy_views), cpu_take=table, x=x)
                assert got.posted
                n, c = int(got.count), int(got.cpu_count)
                if not n and not c:
                    assert int(service.tick) == tick  # nothing to post
                    continue
                posts += 1
                assert int(service.tick) == tick + 1
                row = service.mailbox[tick % RING]
                section = row[HEADER + 2 * E :]
                assert row[0] == tick + 1 and row[1] == n and row[HEADER : HEADER + n].tolist() == got.src[:n].tolist()
                assert section[:4].tolist() == [layer, c, TOKENS * TOP_K, TOP_K]
                assert section[4 : 4 + c].tolist() == got.cpu[:c].tolist()
                assert section[4 + E : 4 + E + TOKENS * TOP_K].tolist() == ids.flatten().tolist()
                if c:
                    assert torch.equal(service.cpu.x[tick % RING], x)
                service.cpu.rows.fill_(float("nan"))
                service.serve()
                on_cpu = (got.slots.flatten() < 0).nonzero()[:, 0]
                assert len(on_cpu) >= c
                want = cpu_pool.compute(banks_cpu[layer], layout, x, on_cpu // TOP_K, ids.flatten()[on_cpu],
                                        torch.empty(len(on_cpu), H))  # fmt: skip
                assert torch.equal(service.cpu.rows[on_cpu], want)
                assert int(service.cpu.done) == (tick + 1 if c else int(service.cpu.done))
                rows_seen += len(on_cpu)
    assert posts and rows_seen


def test_the_round_trip_probe_posts_one_cpu_pair_or_none() -> None:
    """`post_cpu_probe` (what `auto` times with graphs): a row of layer 0 without copies, with one CPU pair (token 0,
    the given expert, over x) or none; served by the C loop, the pair's row is the executor's."""
    from edgemoe.kernels.miss_copy import post_cpu_probe

    g = torch.Generator().manual_seed(3)
    layout = ExpertLayout(H, INTER, torch.float32)
    bank = torch.randn(E, layout.row, generator=g) * 0.3
    pools = layout.copy_views(layout.empty(S + 1))
    gpu = Served([])
    service = CopyService(pools, torch.zeros(E, dtype=torch.long), 1, E, group=0, driver=gpu, max_pairs=2)
    gpu.service = service
    x, expert = torch.randn(1, H, generator=g), torch.tensor([5])
    with CpuExperts(1) as cpu_pool:
        service.attach_cpu(cpu_pool, [(bank, layout, None)], 1)
        for n in (1, 0, 1):
            service.cpu.rows.fill_(float("nan"))
            post_cpu_probe(service.target(layout.copy_views(bank)), expert, x, torch.tensor(n))
            row = service.mailbox[(int(service.tick) - 1) % RING]
            assert row[1] == 0 and row[HEADER + 2 * E : HEADER + 2 * E + 4].tolist() == [0, n, 1, 1]
            service.serve()
            want = cpu_pool.compute(bank, layout, x, torch.tensor([0]), expert, torch.empty(1, H))
            assert torch.equal(service.cpu.rows[:1], want) == bool(n)
        assert int(service.cpu.done) == 3 and service.cpu_timings[0] == 2
