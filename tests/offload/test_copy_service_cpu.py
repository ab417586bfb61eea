"""The copy service's CPU section (`edgemoe/offload/copy_service.c`, `serve_cpu`) on the CPU, with the fake driver of
tests/offload/test_copy_service.py: a stand-in GPU posts mailbox rows as the fused `ensure` writes them (the copy list,
then the CPU section: layer, the experts left to the CPU, the step's routed ids, and the x rows beside the mailbox),
and `serve` runs the CPU expert executor on them. Checked: each CPU pair's output lands in its pair's row of the
"device" buffer, bitwise as `CpuExperts.compute` on the same pairs and within fp32 rounding of a float64 reference
(tests/offload/test_cpu_experts.py's); no other row is written; the flag holds the list's sequence number once the rows
are in (after their copy, in stream order); lists with only CPU pairs, only copies, or both, around the ring; layers
of other formats (a job each); and a list the service cannot serve (no executor, a layer or expert out of range) is
one clear error while the GPU is still released."""

from __future__ import annotations

import pytest
import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.kernels.protocol import HEADER
from edgemoe.offload.copy_service import RING, CopyService
from edgemoe.offload.cpu_experts import CpuExperts
from edgemoe.offload.expert_cache import copy_rows_reference
from tests.offload.test_copy_service import CHUNKS, HostGPU
from tests.offload.test_cpu_experts import make_bank, make_layout, reference

E, S, TOP_K, MAX_TOKENS = 7, 6, 3, 4
MAX_PAIRS = MAX_TOKENS * TOP_K


class Step:
    """One posted list: copies (src -> dst of copy banks `banks`), and CPU pairs: of `ids` [T, TOP_K] (layer `layer`),
    those routed to an expert in `cpu`, over x [T, H]."""

    def __init__(self, src: list, dst: list, banks, layer: int, cpu: list, ids: torch.Tensor, x: torch.Tensor) -> None:
        self.src, self.dst, self.banks = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long), banks
        self.layer, self.cpu, self.ids, self.x = layer, torch.tensor(cpu, dtype=torch.long), ids, x


def post(service: CopyService, step: Step, top_k: int = TOP_K) -> None:
    """What the fused `ensure` writes (`post_list` and the CPU section), the sequence number last."""
    seq = int(service.tick) + 1
    service.tick.fill_(seq)
    row, width = service.mailbox[(seq - 1) % RING], service.max_entries
    n, ids = step.src.numel(), step.ids.flatten()
    row[1:HEADER] = torch.tensor([n, step.banks[0].data_ptr(), step.banks[1].data_ptr()])
    row[HEADER : HEADER + n] = step.src
    row[HEADER + width : HEADER + width + n] = step.dst
    c = HEADER + 2 * width
    row[c : c + 4] = torch.tensor([step.layer, step.cpu.numel(), ids.numel(), top_k])
    row[c + 4 : c + 4 + step.cpu.numel()] = step.cpu
    row[c + 4 + width : c + 4 + width + ids.numel()] = ids
    if step.cpu.numel():
        service.cpu.x[(seq - 1) % RING, : step.x.shape[0]] = step.x
    row[0] = seq


class CpuGPU(HostGPU):
    """`HostGPU` posting `Step`s. At each of its turns it reads the flag (the expert kernels' wait) and calls
    `on_flag(seq)` when it moved."""

    def __init__(self, steps: list[Step], **kwargs) -> None:
        super().__init__([], **kwargs)
        self.steps, self.flag = list(steps), 0
        self.on_flag = lambda seq: None

    def query(self, event: int) -> int:
        self.queries += 1
        service = self.service
        if int(service.tick) > service.served:
            return 600
        if service.cpu is not None and int(service.cpu.done) != self.flag:
            self.flag = int(service.cpu.done)
            self.on_flag(self.flag)
        if self.steps:
            service.counters.zero_()
            post(service, self.steps.pop(0))
            return 600
        return 0


@pytest.fixture(scope="module")
def pool():
    with CpuExperts(2) as p:
        yield p


def make(steps_of, pool: CpuExperts | None, cases=("fp32", "bf16")):
    """A service over small copy pools with a CPU section over one layer of each case's format."""
    g = torch.Generator().manual_seed(7)
    layouts = [make_layout(case) for case in cases]
    layers = [(make_bank(layout, E, g), layout) for layout in layouts]
    copy_banks = [(torch.randn(E, 6, 4, generator=g), torch.randn(E, 4, 3, generator=g)) for _ in range(2)]
    pools = torch.zeros(S + 1, 6, 4), torch.zeros(S + 1, 4, 3)
    gpu = CpuGPU(steps_of(copy_banks, layers, g))
    gpu.service = CopyService(pools, torch.zeros(E, dtype=torch.int64), CHUNKS, E, group=1, driver=gpu,
                              max_pairs=MAX_PAIRS)  # fmt: skip
    if pool is not None:
        gpu.service.attach_cpu(pool, [(bank, layout, None) for bank, layout in layers], MAX_TOKENS)
    return gpu, pools, copy_banks, layers


def routed(g: torch.Generator, tokens: int) -> torch.Tensor:
    """[tokens, TOP_K] distinct experts a token."""
    return torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])


def test_cpu_pairs_land_in_their_rows_bitwise_as_the_executor(pool: CpuExperts) -> None:
    def steps(banks, layers, g):
        out = []
        for i, (tokens, copies) in enumerate([(1, 2), (3, 0), (4, 1), (2, 0), (1, 3)]):  # around the ring
            ids = routed(g, tokens)
            cpu = sorted({int(e) for e in ids.flatten()})[-2:]  # the last misses in expert order
            x = torch.randn(tokens, layers[0][1].hidden, generator=g)
            src, dst = torch.randperm(E, generator=g)[:copies].tolist(), torch.randperm(S, generator=g)[:copies]
            out.append(Step(src, dst.tolist(), banks[i % 2], i % 2, cpu, ids, x))
        return out

    gpu, pools, banks, layers = make(steps, pool)
    posted = list(gpu.steps)
    want_pools = tuple(p.clone() for p in pools)
    for step in posted:
        for w, bank in zip(want_pools, step.banks):
            copy_rows_reference(w, bank, step.src, step.dst)
    rows = gpu.service.cpu.rows
    seen = []

    def check_after(seq: int) -> None:  # the rows of list `seq`, as its flag says they are in
        step = posted[seq - 1]
        bank, layout = layers[step.layer]
        flat = step.ids.flatten()
        on_cpu = torch.isin(flat, step.cpu).nonzero()[:, 0]
        tokens, experts = on_cpu // TOP_K, flat[on_cpu]
        want = pool.compute(bank, layout, step.x, tokens, experts, torch.empty(len(on_cpu), layout.hidden))
        assert torch.equal(rows[on_cpu], want)
        ref, atol = reference(bank, layout, step.x, tokens, experts)
        assert ((want.double() - ref).abs() <= 1e-5 * ref.abs() + atol).all()
        seen.append(seq)

    def on_flag(seq: int) -> None:  # list `seq`'s rows, as its flag says they are in
        check_after(seq)
        rows.fill_(float("nan"))  # a later list's rows must all be written again

    gpu.on_flag = on_flag
    gpu.service.serve()
    assert seen == [1, 2, 3, 4, 5] and int(gpu.service.cpu.done) == 5
    assert gpu.service.cpu_timings[0] == 5 and gpu.service.cpu_timings[1] > 0
    for pool_, w in zip(pools, want_pools):
        assert torch.equal(pool_, w)  # the copies as without CPU pairs


def test_only_cpu_pairs_rows_are_written(pool: CpuExperts) -> None:
    """One copy of the CPU pairs' span (the rows between are never read); rows outside it keep what they held."""
    ids = torch.tensor([[0, 4, 5], [1, 4, 6]])
    x = torch.randn(2, make_layout("fp32").hidden)

    gpu, _, _, layers = make(lambda banks, layers, g: [Step([], [], banks[0], 0, [4, 6], ids, x)], pool)
    rows = gpu.service.cpu.rows
    rows.fill_(float("nan"))
    gpu.service.serve()
    written = ~rows.isnan().any(dim=1)
    assert written.tolist() == [1 <= i <= 5 for i in range(MAX_PAIRS)]  # (0,4) .. (1,6): one copy of that span
    bank, layout = layers[0]
    want = pool.compute(bank, layout, x, torch.tensor([0, 1, 1]), torch.tensor([4, 4, 6]), torch.empty(3, 200))
    assert torch.equal(rows[[1, 4, 5]], want)
    assert gpu.copies == 1 and int(gpu.service.cpu.done) == 1  # one copy of rows 1..5, then the flag
    assert gpu.writes[-1][2] == 1


def test_a_list_it_cannot_serve_is_an_error_and_still_releases_the_gpu(pool: CpuExperts) -> None:
    """No executor (detached), a layer out of range, an expert out of the bank's range."""
    ids = torch.tensor([[0, 1, 2]])
    x = torch.randn(1, make_layout("fp32").hidden)
    cases = [
        (Step([3], [0], None, 0, [2], ids, x), "a list it cannot serve"),
        (Step([], [], None, 2, [2], ids, x), "a list it cannot serve"),
        (Step([], [], None, 0, [9], torch.tensor([[0, 9, 2]]), x), "a token or expert index out of range"),
    ]
    for i, (bad, why) in enumerate(cases):
        gpu, *_ = make(lambda banks, layers, g, bad=bad: [_with_banks(bad, banks)], pool)
        if i == 0:
            gpu.service.detach_cpu()
        with pytest.raises(EdgeMoEError, match=f"CPU experts failed: {why}"):
            gpu.service.serve()
        assert gpu.service.served == 1 and int(gpu.service.cpu.done) == 1  # released all the same
        assert gpu.writes[-1][2] == 1 and len(gpu.writes) == bad.src.numel() + 1  # the counters, then the flag


def _with_banks(step: Step, banks) -> Step:
    step.banks = banks[0]
    return step


def test_attach_checks_room_and_detach_forgets_the_pool(pool: CpuExperts) -> None:
    gpu, *_ = make(lambda banks, layers, g: [], pool)
    assert gpu.service.target(tuple(torch.zeros(E, *shape) for shape in ((6, 4), (4, 3)))).cpu_x is gpu.service.cpu.x
    gpu.service.detach_cpu()
    assert not gpu.service._state.cpu_run
    with pytest.raises(EdgeMoEError, match="needs room"):
        make(lambda banks, layers, g: [], pool)[0].service.attach_cpu(pool, [], 0)


def test_resolve_attaches_the_pool_and_close_detaches_it(pool: CpuExperts) -> None:
    """`resolve` with a copy service (graphs): the pool serves the service's CPU pairs from the layers' banks; closing
    the split detaches it before the pool stops."""
    from edgemoe.offload.cpu_split import resolve

    gpu, _, _, layers = make(lambda banks, layers, g: [], None, cases=("fp32", "fp32"))

    class Layer:  # what resolve reads of an OffloadedExperts
        def __init__(self, i: int) -> None:
            self.layer, (self.bank, self.layout), self.num_experts = i, layers[i], E

        def host_biases(self) -> None:
            return None

    split = resolve(2, [Layer(0), Layer(1)], torch.device("cpu"), TOP_K, True, service=gpu.service,
                    max_tokens=MAX_TOKENS)  # fmt: skip
    assert split.table.tolist()[:4] == [0, 1, 2, 2] and not split.fitted and split.service is gpu.service
    assert gpu.service._state.cpu_run and gpu.service.cpu.x.shape == (RING, MAX_TOKENS, 200)
    assert gpu.service._state.cpu_layers == 2
    split.close()
    assert not gpu.service._state.cpu_run
