"""`bench/op_traffic.py`: the bytes and FLOPs counted for each aten op, against counts worked out by hand."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location("bench_op_traffic", Path(__file__).parents[1] / "bench" / "op_traffic.py")
op_traffic = sys.modules["bench_op_traffic"] = importlib.util.module_from_spec(spec)  # its dataclass looks it up
spec.loader.exec_module(op_traffic)
Traffic = op_traffic.Traffic


def counted(fn, inference: bool = False) -> Traffic:
    """What ``fn()`` moved, summed over its ops."""
    with torch.inference_mode(inference), op_traffic.OpTraffic() as traffic:
        fn()
    return op_traffic.total(traffic.by_op["other"].values())


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_elementwise_ops_read_their_arguments_and_write_their_results(n):
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    assert counted(lambda: a + b) == Traffic(1, 8 * n, 4 * n, 0)
    assert counted(lambda: a.add_(b)) == Traffic(1, 8 * n, 4 * n, 0)  # in place: self read and written
    assert counted(lambda: torch.add(a, b, out=c)) == Traffic(1, 8 * n, 4 * n, 0)  # out= is written, not read
    assert counted(lambda: a.double()) == Traffic(1, 4 * n, 8 * n, 0)
    assert counted(lambda: c.copy_(a)) == Traffic(1, 4 * n, 4 * n, 0)  # a copy or a fill does not read its target
    assert counted(lambda: c.fill_(2.0)) == Traffic(1, 0, 4 * n, 0)
    assert counted(lambda: c.zero_()) == Traffic(1, 0, 4 * n, 0)


@pytest.mark.parametrize("rows,cols", [(3, 5), (10, 100)])
def test_an_expanded_argument_counts_its_distinct_elements_once(rows, cols):
    col, grid = torch.rand(rows, 1), torch.rand(rows, cols)
    assert counted(lambda: grid + col.expand(rows, cols)) == Traffic(1, 4 * rows * cols + 4 * rows, 4 * rows * cols, 0)


def test_views_and_uninitialised_tensors_are_no_ops():
    x = torch.rand(6, 4)
    assert counted(lambda: (x.view(4, 6), x.t(), x[1:3], torch.empty(100))) == Traffic(0, 0, 0, 0)


@pytest.mark.parametrize("k", [1, 3])
def test_a_gather_reads_what_it_gathers_and_a_scatter_writes_what_it_scatters(k):
    src, index, values, into = torch.rand(1000), torch.arange(k), torch.rand(k), torch.zeros(1000)
    assert counted(lambda: src.gather(0, index)) == Traffic(1, 8 * k + 4 * k, 4 * k, 0)
    assert counted(lambda: src.index_select(0, index)) == Traffic(1, 8 * k + 4 * k, 4 * k, 0)
    assert counted(lambda: into.scatter_(0, index, values)) == Traffic(1, 8 * k + 4 * k, 4 * k, 0)
    assert counted(lambda: into.index_fill_(0, index, 1.0)) == Traffic(1, 8 * k, 4 * k, 0)
    table = torch.rand(50, 8)
    assert counted(lambda: torch.nn.functional.embedding(index, table)) == Traffic(1, 8 * k + 32 * k, 32 * k, 0)


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("m,k,n", [(4, 8, 3), (1, 64, 17)])
def test_matmuls_count_their_flops_composite_ones_decomposed(m, k, n, inference):
    a, b, w = torch.rand(m, k), torch.rand(k, n), torch.rand(n, k)
    assert counted(lambda: a @ b, inference).flops == 2 * m * k * n
    assert counted(lambda: torch.nn.functional.linear(a, w), inference).flops == 2 * m * k * n
    assert counted(lambda: torch.bmm(a[None], b[None]), inference) == Traffic(1, 4 * (m * k + k * n), 4 * m * n,
                                                                              2 * m * k * n)  # fmt: skip


def test_buckets_nest_and_restore():
    x = torch.rand(10)
    with op_traffic.OpTraffic() as traffic:
        x + x
        with traffic.bucket("inner"):
            x * x
            with traffic.bucket("innermost"):
                x - x
            x / x
        x + 1
    assert {b: sorted(ops) for b, ops in traffic.by_op.items()} == {"other": ["add"], "inner": ["div", "mul"],
                                                                     "innermost": ["sub"]}  # fmt: skip
    assert traffic.by_op["other"]["add"].ops == 2
