"""Metrics: defined answers for zeros, single elements, NaN and Inf; streaming equals one pass."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import without_compiler

from pi0align.compare.measuring.metrics import metrics_of_sums, sample_metrics, stats_metrics, tensor_sums

pytestmark = pytest.mark.filterwarnings("error")


def tensor_metrics(a, b, **how) -> dict[str, float]:
    """The metrics of one pair, as compare takes them: its sums, then the metrics of the sums."""
    return {k: float(v[0]) for k, v in metrics_of_sums(tensor_sums(a, b, **how)[None]).items()}


def test_known_values():
    b = np.array([1.0, 2.0, 4.0])
    n = np.array([1.0, 2.0, 4.008])
    m = tensor_metrics(b, n)
    assert m["max_abs_err"] == pytest.approx(0.008)
    assert m["max_rel_err"] == pytest.approx(2e-3) and m["mean_rel_err"] == pytest.approx(2e-3 / 3)
    assert m["rel_l2_err"] == pytest.approx(0.008 / np.sqrt(21))
    assert m["rmse"] == pytest.approx(0.008 / np.sqrt(3))
    assert m["within_5e-3"] == 1.0 and m["within_1e-3"] == pytest.approx(2 / 3)
    assert 0.99999 < m["cosine"] < 1.0 and m["nan_inf_mismatch"] == 0


@pytest.mark.parametrize("b, n, expected", [
    ([0.0, 0.0], [0.0, 0.0], {"cosine": 1.0, "rel_l2_err": 0.0, "max_rel_err": 0.0, "within_1e-3": 1.0}),
    ([0.0, 0.0], [1.0, 0.0], {"cosine": 0.0, "rel_l2_err": np.inf, "max_rel_err": np.inf, "within_1e-3": 0.5}),
    ([3.0], [3.0], {"cosine": 1.0, "rel_l2_err": 0.0, "rmse": 0.0}),
    ([2.0], [-2.0], {"cosine": -1.0, "rel_l2_err": 2.0}),
    ([np.nan, 1.0], [np.nan, 1.0], {"nan_inf_mismatch": 0, "rel_l2_err": 0.0}),
    ([np.inf, 1.0], [np.inf, 1.0], {"nan_inf_mismatch": 0, "rel_l2_err": 0.0}),
    ([np.inf, 1.0], [-np.inf, 1.0], {"nan_inf_mismatch": 1, "rel_l2_err": 0.0}),
    ([np.nan, 1.0], [5.0, 1.0], {"nan_inf_mismatch": 1, "rel_l2_err": 0.0}),
    ([np.nan], [np.nan], {"nan_inf_mismatch": 0, "rel_l2_err": np.nan, "cosine": np.nan}),
])
def test_edge_cases_have_defined_answers(b, n, expected):
    m = tensor_metrics(np.array(b), np.array(n))
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, nan_ok=True), key


def test_scalar_tensor():
    m = tensor_metrics(np.float32(2.0), np.float32(2.5))
    assert m["max_abs_err"] == 0.5 and m["rel_l2_err"] == 0.25


def test_streaming_in_chunks_and_threads_equals_one_pass(loops):
    rng = np.random.default_rng(0)
    b = rng.standard_normal((300, 70)).astype(np.float32)
    n = (b * (1 + 1e-4 * rng.standard_normal(b.shape))).astype(np.float32)
    b[3, 4], n[3, 4] = 0.0, 0.0
    n[5, 6] = np.nan
    whole = tensor_metrics(b, n, chunk_elements=1 << 20, workers=1, loops=loops)  # in memory: one pass as it is
    chunked = tensor_metrics(b, n, chunk_elements=500, workers=3, loops=loops)
    for key in whole:
        assert chunked[key] == pytest.approx(whole[key], rel=1e-9), key
    assert whole["nan_inf_mismatch"] == 1
    # many pairs' sums at once give each pair's metrics
    other = tensor_sums(b[:7], n[:7] * 2, loops=loops)
    both = metrics_of_sums(np.stack([tensor_sums(b, n, loops=loops), other]))
    assert {k: v[0] for k, v in both.items()} == pytest.approx(whole, rel=1e-12, nan_ok=True)
    assert {k: v[1] for k, v in both.items()} == pytest.approx(tensor_metrics(b[:7], n[:7] * 2, loops=loops),
                                                               rel=1e-12)


def test_samples_are_per_row_and_unused_slots_ignored():
    b = np.array([[1.0, 2.0, np.nan], [1.0, 1.0, 1.0]])
    n = np.array([[1.0, 2.2, np.nan], [1.0, 1.0, 1.0]])
    m = sample_metrics(b, n)
    assert m["max_abs_err"] == pytest.approx([0.2, 0.0])
    assert m["rel_l2_err"][1] == 0.0 and m["nan_inf_mismatch"].tolist() == [0, 0]


def test_statistics_errors_are_scaled_by_the_tensor_not_the_statistic():
    b = {"min": np.array([-1.0]), "max": np.array([1.0]), "mean": np.array([1e-9]), "norm": np.array([10.0]),
         "numel": np.array([100])}
    n = {"min": np.array([-1.001]), "max": np.array([1.0]), "mean": np.array([2e-9]), "norm": np.array([10.0]),
         "numel": np.array([100])}
    m = stats_metrics(b, n)
    assert m["mean_val_rel_err"][0] == pytest.approx(1e-9)  # not 100%: the mean is near zero, RMS is 1
    assert m["min_rel_err"][0] == pytest.approx(1e-3) and m["norm_rel_err"][0] == 0.0


def test_statistics_of_all_nan_tensors():
    nan = {k: np.array([np.nan]) for k in ("min", "max", "mean", "norm")} | {"numel": np.array([4])}
    one = {k: np.array([1.0]) for k in ("min", "max", "mean", "norm")} | {"numel": np.array([4])}
    assert all(v[0] == 0 for v in stats_metrics(nan, nan).values())
    assert all(np.isinf(v[0]) for v in stats_metrics(one, nan).values())


@pytest.mark.parametrize("filters", [dict(compression=32015, compression_opts=(1,), shuffle=True),
                                     dict(compression="gzip", shuffle=True), dict(compression="gzip"), {}],
                         ids=["zstd+shuffle", "gzip+shuffle", "gzip", "uncompressed-chunked"])
def test_compressed_hdf5_chunks_read_in_parallel_equal_in_memory(tmp_path, filters, loops):
    import h5py
    import hdf5plugin  # noqa: F401 - the Zstandard filter (id 32015), as pi0align writes tensors

    from pi0align.compare.reading.records import Bfloat16Array

    rng = np.random.default_rng(1)
    b = rng.standard_normal((300, 70)).astype(np.float32)  # not a multiple of the chunk shape: edge chunks
    n = (b * (1 + 1e-3 * rng.standard_normal(b.shape))).astype(np.float32)
    with h5py.File(tmp_path / "t.h5", "w") as f:
        for name, value in (("b", b), ("n", n), ("b16", b.view(np.uint32) >> 16), ("n16", n.view(np.uint32) >> 16)):
            f.create_dataset(name, data=value.astype(np.uint16) if "16" in name else value, chunks=(64, 32), **filters)
        for name, value in (("b_rows", b), ("n_rows", n)):  # chunks of whole rows, as pi0align writes them
            f.create_dataset(name, data=value, chunks=(64, 70), **filters)
    with h5py.File(tmp_path / "t.h5", "r") as f:
        from pi0align.compare.reading.h5chunks import chunk_layout

        assert chunk_layout(f["b"]) is not None  # read chunk by chunk, not through h5py
        expected = tensor_metrics(b, n, workers=1, loops=loops)
        assert expected["max_row_rel_l2_err"] > expected["rel_l2_err"]
        # chunks that split rows do not measure the largest row error
        split_rows = {**expected, "max_row_rel_l2_err": np.nan}
        for workers in (1, 3):
            got = tensor_metrics(f["b"], f["n"], chunk_elements=5000, workers=workers, loops=loops)
            assert got == pytest.approx(split_rows, rel=1e-9, nan_ok=True)
            got = tensor_metrics(f["b_rows"], f["n_rows"], chunk_elements=5000, workers=workers, loops=loops)
            assert got == pytest.approx(expected, rel=1e-9)
        bf16 = tensor_metrics(Bfloat16Array(f["b16"]), Bfloat16Array(f["n16"]), workers=2, loops=loops)
        in_memory = tensor_metrics(Bfloat16Array(f["b16"][()]), Bfloat16Array(f["n16"][()]), loops=loops)
        assert bf16 == pytest.approx({**in_memory, "max_row_rel_l2_err": np.nan}, rel=1e-9, nan_ok=True)



@pytest.fixture(params=["compiled", "numpy"])
def loops(request):
    """kernels.py's two implementations; the compiled one skipped where it cannot be built."""
    from pi0align.compare.measuring.kernels import CompiledLoops, NumpyLoops, comparison_loops

    if request.param == "numpy":
        return NumpyLoops()
    if not isinstance(comparison_loops(), CompiledLoops):
        pytest.skip(f"no compiled loops here ({comparison_loops().status})")
    return comparison_loops()


def test_without_a_compiler_the_numpy_loops_run(tmp_path, monkeypatch):
    from pi0align.compare.measuring.kernels import NumpyLoops, comparison_loops

    without_compiler(tmp_path, monkeypatch)
    comparison_loops.cache_clear()  # chosen once per process: choose again, here without a compiler
    try:
        chosen = comparison_loops()
        assert isinstance(chosen, NumpyLoops) and "no-such-compiler" in chosen.status
    finally:
        comparison_loops.cache_clear()


def _awkward_pair(rng, dtype):
    """3 rows of 3000: zeros, NaN/Inf agreeing and not, exact ties, small differences; past one kernel block."""
    if np.dtype(dtype).kind == "i":
        return rng.integers(-5, 5, (3, 3000), dtype=dtype), rng.integers(-5, 5, (3, 3000), dtype=dtype)
    b = rng.standard_normal(9000).astype(dtype)
    n = (b * (1 + 1e-3 * rng.standard_normal(9000))).astype(dtype)
    b[[5, 6]], n[[5, 6]] = 0, [0, 1]
    b[[2000, 2001, 2002]], n[[2000, 2001, 2002]] = [np.nan, np.inf, np.inf], [np.nan, np.inf, 1.0]
    n[3000] = np.nan
    n[4000:4100] = b[4000:4100]
    return b.reshape(3, 3000), n.reshape(3, 3000)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "bfloat16"])
def test_compiled_and_numpy_loops_agree(dtype):
    from pi0align.compare.measuring.kernels import CompiledLoops, NumpyLoops, comparison_loops
    from pi0align.compare.reading.records import Bfloat16Array

    if not isinstance(comparison_loops(), CompiledLoops):
        pytest.skip(f"no compiled loops here ({comparison_loops().status})")
    b, n = _awkward_pair(np.random.default_rng(2), "float32" if dtype == "bfloat16" else dtype)
    if dtype == "bfloat16":
        b, n = (Bfloat16Array((x.view(np.uint32) >> 16).astype(np.uint16)) for x in (b, n))

    def both_ways(loops):
        rows = sample_metrics(np.asarray(b[:], np.float64), np.asarray(n[:], np.float64), loops)
        return tensor_metrics(b, n, chunk_elements=1000, loops=loops), rows

    compiled, compiled_rows = both_ways(comparison_loops())
    numpy, numpy_rows = both_ways(NumpyLoops())
    assert compiled == pytest.approx(numpy, rel=1e-12, nan_ok=True)
    for key, values in numpy_rows.items():
        assert compiled_rows[key] == pytest.approx(values, rel=1e-12, nan_ok=True), key
    if dtype != "int32":
        assert compiled["nan_inf_mismatch"] == 2 and compiled["max_rel_err"] == np.inf


def _largest_row_error(b: np.ndarray, n: np.ndarray) -> float:
    """max over the rows of the last dimension of ‖n_r − b_r‖ / ‖b_r‖, NaN/Inf positions left out."""
    rows = b.shape[-1] if b.ndim > 1 else max(b.size, 1)
    b, n = (np.asarray(x, np.float64).reshape(-1, rows) for x in (b, n))
    kept = np.isfinite(b) & np.isfinite(n)
    d, b = np.where(kept, n - b, 0.0), np.where(kept, b, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.sqrt((d * d).sum(1) / (b * b).sum(1))
    return float(np.nan_to_num(ratio, nan=0.0, posinf=np.inf).max())  # 0/0 = 0, x/0 = inf


@pytest.mark.parametrize("shape", [(), (7,), (5, 1), (40, 56, 1), (8, 56, 256), (3, 70001)])
def test_the_largest_row_error_is_taken_over_the_last_dimension_on_every_path(shape, loops):
    """The worst row's relative L2 error (the product bound of a per-row scale, bounds.py): rows of
    zeros, a row further off than the rest, NaN where both sides hold one; in memory and read in
    row ranges, by either loops."""
    rng = np.random.default_rng(2)
    b = rng.standard_normal(shape).astype(np.float32)
    n = (b * (1 + 1e-3 * rng.standard_normal(shape))).astype(np.float32)
    if b.ndim > 1:
        b[0], n[0] = 0.0, 0.0
        n[-1] *= 1.02
    if b.size > 10:
        b.flat[3] = n.flat[3] = np.nan
    expected = _largest_row_error(b, n)
    assert expected > 0
    for how in ({}, {"chunk_elements": 1000, "workers": 3}):
        assert tensor_metrics(b, n, loops=loops, **how)["max_row_rel_l2_err"] == pytest.approx(expected, rel=1e-9)
    assert np.isnan(sample_metrics(b.reshape(1, -1), n.reshape(1, -1), loops)["max_row_rel_l2_err"]).all()
