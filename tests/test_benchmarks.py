"""The benchmark harness (benchmarks/common.py, plot.py, bench_forward.py, bench_grid.py) on the
CPU: which rows count as accurate, that a speedup only compares rows of one run, that a skipped
pair replaces an older run's row, that plot.py passes over files that are not benchmark results,
that a run whose own rows fail says so in its exit status, that the shape grid measures, skips
and summarizes its points, and that the KernelBench timing checks ModelNew. Also that
research/simulate_certified.py, the certified bound's CPU model, still runs from its place and
covers the arg-max.

The harness is not part of the package: these tests load it from the source tree beside them and
skip where there is none (an sdist's tests).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
if not (BENCH_DIR / "common.py").exists():
    pytest.skip("needs the source tree's benchmarks/", allow_module_level=True)


def _load(name):
    """benchmarks/<name>.py as a module (the scripts import each other as top-level modules)."""
    path = BENCH_DIR / f"{name}.py"
    if getattr(sys.modules.get(name), "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


common = _load("common")

SHAPE = dict(K=64, O=64, k=4, scale=2.0, dtype="float32", x="rand")


def _row(impl, b, us, run_id="run-a", mode="forward", **fields):
    row = dict(impl=impl, mode=mode, B=b, median_us=us, rel_err_fp64=1e-7, max_abs_err=1e-7,
               allclose_ref=True, **SHAPE, date=run_id, run_id=run_id, error=None)
    if mode == "train":
        row["grad_rel_err_fp64"] = {"weight": 1e-7, "bias": 1e-7, "x": 1e-7}
    row.update(fields)
    return row


def test_is_accurate_needs_every_element_and_every_gradient():
    assert common.is_accurate(_row("ours_op", 1, 10.0))
    # One wrong row in a large batch: the batch-wide norm stays small, allclose does not.
    assert not common.is_accurate(_row("ours_op", 1, 10.0, allclose_ref=False))
    assert not common.is_accurate(_row("ours_op", 1, 10.0, rel_err_fp64=2e-5))
    assert not common.is_accurate(_row("ours_op", 1, None))
    train = _row("ours_model", 1, 10.0, mode="train")
    assert common.is_accurate(train)
    for name in ("weight", "bias", "x"):
        for bad in (None, 1e-3):  # a step that leaves a gradient out, or gets it wrong
            grads = dict(train["grad_rel_err_fp64"], **{name: bad})
            assert not common.is_accurate(dict(train, grad_rel_err_fp64=grads)), (name, bad)
    assert not common.is_accurate(dict(train, grad_rel_err_fp64=None))
    # Half types: allclose in their own tolerance decides.
    half = _row("ours_op", 1, 10.0, dtype="bfloat16", rel_err_fp64=1e-3)
    assert common.is_accurate(half)
    assert not common.is_accurate(dict(half, allclose_ref=False))


def _speedups(markdown, b):
    """The speedup cells of batch b's line of the time table."""
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {b} |"))
    return [cell.strip() for cell in line.strip("|").split("|") if cell.strip().endswith("x")
            or cell.strip() == "-"][-2:]


def test_speedups_compare_rows_of_one_run_only():
    rows = [
        _row("fold_eager", 1, 40.0, run_id="run-a"),
        _row("ours_op", 1, 10.0, run_id="run-a"),
        _row("ours_model", 1, 8.0, run_id="run-b"),  # no peer in its run
        # An inaccurate faster peer is never the best one.
        _row("fold_compile", 1, 5.0, run_id="run-a", rel_err_fp64=1e-4),
    ]
    table = common.markdown_tables(rows, "forward")
    assert _speedups(table, 1) == ["4.00x", "-"]
    assert "Rows from 2 runs" in table
    assert "5.0*" in table


def test_the_best_peer_is_float32_accurate_in_float32_only():
    # In float32 a peer counts when it is float32-accurate, and the header says so; in a half
    # dtype the allclose check alone decides, and a relative error of 1e-3 is no reason to drop it.
    for dtype, header in (("float32", "best fp32 peer"), ("bfloat16", "best peer")):
        rows = [_row("fold_eager", 1, 20.0, dtype=dtype, rel_err_fp64=1e-3),
                _row("ours_op", 1, 10.0, dtype=dtype, rel_err_fp64=1e-3)]
        table = common.markdown_tables(rows, "forward")
        assert f"| {header} of the run (us) |" in table
        assert ("| 1 | 20.0* | 10.0* | - | - |" if dtype == "float32"
                else "| 1 | 20.0 | 10.0 | 20.0 (fold_eager) | 2.00x |") in table


def test_a_skipped_pair_replaces_the_older_runs_row(tmp_path):
    path = tmp_path / "results.json"
    meta = {"run_id": "run-a"}
    common.merge_rows(path, [_row("fold_eager", 1, 40.0), _row("ours_op", 1, 10.0)],
                      {"device": "cpu"}, "forward", meta)
    skipped = _row("fold_eager", 1, None, run_id="run-b",
                   error=f"{common.SKIPPED} (past --deadline-s 1)")
    data = common.merge_rows(path, [skipped, _row("ours_op", 1, 9.0, run_id="run-b")],
                             {"device": "cpu"}, "forward", {"run_id": "run-b"})
    assert [r["run_id"] for r in data["rows"]] == ["run-b", "run-b"]
    assert set(data["runs"]) == {"run-b"}
    table = common.markdown_tables(data["rows"], "forward")
    assert "| 1 | skipped | 9.0 |" in table


def test_plot_passes_over_files_that_are_not_benchmark_results(tmp_path):
    plot = _load("plot")
    results = tmp_path / "gpu.json"
    common.merge_rows(results, [_row("fold_eager", 1, 40.0), _row("ours_op", 1, 10.0)],
                      {"device": "cpu", "date": "run-a", "torch": "x"}, "forward",
                      {"run_id": "run-a"})
    floors = tmp_path / "gpu-floors.json"
    floors.write_text(json.dumps({"rows": [{"what": "a one-element kernel", "us": 4.8}]}))
    out = tmp_path / "out"
    assert plot.main([str(floors), str(results), "--no-png", "--out-dir", str(out)]) == 0
    assert (out / "gpu.md").exists() and not (out / "gpu-floors.md").exists()
    assert "4.00x" in (out / "gpu.md").read_text()


@pytest.mark.parametrize("broken", [False, True], ids=["ours-accurate", "ours-wrong"])
def test_the_exit_status_says_whether_ours_is_accurate(broken, monkeypatch, capsys):
    bench = _load("bench_forward")
    if broken:
        build = bench.BUILDERS["ours_op"]

        def build_wrong(ctx):
            fn = build(ctx)
            return lambda x: fn(x) * 1.01

        monkeypatch.setitem(bench.BUILDERS, "ours_op", build_wrong)
    argv = ["--device", "cpu", "--batches", "1", "3", "-K", "64", "-O", "64", "-k", "4",
            "--impls", "fold_eager", "ours_op", "--warmup", "1", "--rep", "5", "--no-save"]
    assert bench.main(argv) == (1 if broken else 0)
    output = capsys.readouterr().out
    assert ("ERROR: ours failed or is not accurate at ours_op B=1, ours_op B=3" in output) == broken


def test_pairs_past_the_deadline_are_written_as_skipped(tmp_path):
    bench = _load("bench_forward")
    path = tmp_path / "results.json"
    argv = ["--device", "cpu", "--batches", "1", "-K", "64", "-O", "64", "-k", "4",
            "--impls", "fold_eager", "ours_op", "--warmup", "1", "--rep", "5", "--out", str(path)]
    assert bench.main(argv) == 0
    first = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}
    assert all(r["median_us"] is not None for r in first.values())
    assert bench.main(argv + ["--deadline-s", "1e-9"]) == 0  # every pair past it
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 2
    assert all(r["median_us"] is None and r["error"].startswith(common.SKIPPED) for r in rows)


def test_float32_cuda_peers_are_left_out_of_a_cpu_or_half_type_runs_default_impls():
    impls = _load("bench_forward").IMPLS
    default = common.parse_args("forward", impls, 1.0, ["--device", "cpu"])
    assert "fold_tail" not in default.impls and "ours_op" in default.impls
    assert "fold_tail" in common.default_impls(impls, "cuda", "float32")
    for dtype in ("bfloat16", "float16"):
        chosen = common.default_impls(impls, "cuda", dtype)
        assert "fold_tail" not in chosen and "ours_op" in chosen and "fold_eager" in chosen
    chosen = common.parse_args("forward", impls, 1.0, ["--device", "cpu", "--impls", "fold_tail"])
    assert chosen.impls == ["fold_tail"]  # asked for by name: kept, and its row says why it fails


def test_graph_replay_rows_are_a_configuration_of_their_own(tmp_path):
    path = tmp_path / "results.json"
    old_eager = _row("ours_op", 1, 12.0, run_id="run-a")
    assert "launch" not in old_eager  # a row from before the field: eager
    common.merge_rows(path, [old_eager], {"device": "gpu"}, "forward", {"run_id": "run-a"})
    graph = _row("ours_op", 1, 8.0, run_id="run-b", launch="graph")
    common.merge_rows(path, [graph], {"device": "gpu"}, "forward", {"run_id": "run-b"})
    rows = json.loads(path.read_text())["rows"]
    assert sorted(r.get("launch", "eager") for r in rows) == ["eager", "graph"]
    eager = _row("ours_op", 1, 11.0, run_id="run-c", launch="eager")
    data = common.merge_rows(path, [eager], {"device": "gpu"}, "forward", {"run_id": "run-c"})
    assert sorted((r["launch"], r["median_us"]) for r in data["rows"]) == [
        ("eager", 11.0), ("graph", 8.0)]
    markdown = _load("plot").markdown(data, "results.json")
    assert markdown.count("Shape: ") == 2
    assert "x ~ rand, CUDA-graph replays." in markdown and "x ~ rand." in markdown


def test_cuda_graph_replays_need_a_cuda_device_and_no_compiled_graphs(capsys):
    impls = _load("bench_forward").IMPLS

    def refusal(mode, *argv):
        with pytest.raises(SystemExit):
            common.parse_args(mode, impls, 1.0, list(argv))
        return capsys.readouterr().err

    assert "--cuda-graph needs a CUDA device, got --device cpu" in refusal(
        "forward", "--device", "cpu", "--cuda-graph")
    assert "--cuda-graph needs a CUDA device, got --device cpu" in refusal(
        "train", "--device", "cpu", "--cuda-graph")
    if common.resolve_device(None).type == "cuda":
        assert "would capture CUDA graphs inside that capture" in refusal(
            "forward", "--cuda-graph", "--compile-mode", "reduce-overhead")


@pytest.mark.cuda
@pytest.mark.graphs
def test_cuda_graph_replays_are_timed_and_checked(tmp_path, monkeypatch):
    import torch

    bench = _load("bench_forward")
    path = tmp_path / "results.json"
    argv = ["--batches", "1", "5", "-K", "96", "-O", "64", "-k", "4", "--impls", "fold_eager",
            "ours_op", "ours_model", "--warmup", "1", "--rep", "5", "--out", str(path)]
    assert bench.main(argv + ["--cuda-graph"]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 6 and all(r["launch"] == "graph" for r in rows)
    assert all(common.is_accurate(r) for r in rows), rows
    # The replay's output is what is checked: an op whose captured calls alone compute the wrong
    # numbers (its eager ones are right) fails its rows.
    build = bench.BUILDERS["ours_op"]

    def build_wrong(ctx):
        fn = build(ctx)
        return lambda x: fn(x) * (1.01 if torch.cuda.is_current_stream_capturing() else 1.0)

    monkeypatch.setitem(bench.BUILDERS, "ours_op", build_wrong)
    assert bench.main(argv[:-2] + ["--no-save", "--impls", "ours_op", "--cuda-graph"]) == 1


@pytest.mark.cuda
@pytest.mark.graphs
def test_cuda_graph_replays_of_training_steps_are_timed_and_checked(tmp_path, monkeypatch):
    import torch

    bench = _load("bench_train")
    path = tmp_path / "results.json"
    argv = ["--batches", "1", "5", "-K", "96", "-O", "64", "-k", "4", "--impls", "fold_eager",
            "ours_model", "--warmup", "1", "--rep", "5", "--out", str(path), "--cuda-graph"]
    assert bench.main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 4 and all(r["launch"] == "graph" and r["mode"] == "train" for r in rows)
    assert all(common.is_accurate(r) for r in rows), rows
    # The replay's output and gradients are what is checked: a model whose captured steps alone
    # are off by 1% (its eager ones are right) fails its rows.
    build = bench.BUILDERS["ours_model"]

    def build_wrong(ctx):
        impl = build(ctx)
        forward = impl.forward
        impl.forward = lambda x: forward(x) * (
            1.01 if torch.cuda.is_current_stream_capturing() else 1.0)
        return impl

    monkeypatch.setitem(bench.BUILDERS, "ours_model", build_wrong)
    assert bench.main(argv[:-3] + ["--no-save", "--impls", "ours_model", "--cuda-graph"]) == 1


def test_the_certified_bound_model_in_research_still_runs():
    path = BENCH_DIR.parent / "research" / "simulate_certified.py"
    if not path.exists():
        pytest.skip("needs the source tree's research/")
    pytest.importorskip("numpy")
    spec = importlib.util.spec_from_file_location("simulate_certified", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.simulate(32, 256, 64, 4, 2.0, "rand", "model", seed=0)
    assert result["max_err_over_bound"] < 1 and result["argmax_always_candidate"], result


def test_the_grid_measures_its_points_skips_those_over_the_memory_budget_and_reports(tmp_path):
    grid = _load("bench_grid")
    path = tmp_path / "cpu-grid.json"
    # A budget just below the largest point's estimate: that point alone is skipped.
    budget_gib = (grid.point_bytes(3, 64, 4, "float32") - 1) / 2**30
    argv = ["--device", "cpu", "--K", "64", "--N", "2", "4", "--batches", "1", "3", "--dtypes",
            "float32", "--skip-compile", "--warmup", "1", "--rep", "5", "--out", str(path),
            "--memory-budget-gib", str(budget_gib)]
    assert grid.main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {(r["O"] // r["k"], r["B"], r["impl"]) for r in rows} == {
        (n, b, impl) for n in (2, 4) for b in (1, 3) for impl in ("fold_eager", "ours_op")}
    skipped = [r for r in rows if common.is_skipped(r)]
    assert {(r["O"] // r["k"], r["B"]) for r in skipped} == {(4, 3)}
    assert all("memory" in r["error"] for r in skipped)
    assert all(common.is_accurate(r) for r in rows if not common.is_skipped(r)), rows
    report = (tmp_path / "cpu-grid.md").read_text()
    assert "3 of 4 points timed against an accurate peer" in report
    assert "Not measured, skipped (memory:" in report and "K = 64, N = 4, B = 3" in report
    # plot.py renders a grid file as a grid, the same report.
    out = tmp_path / "out"
    assert _load("plot").main([str(path), "--no-png", "--out-dir", str(out)]) == 0
    assert (out / "cpu-grid.md").read_text() == report


def test_the_grid_summary_names_the_worst_point_and_where_ours_is_not_ahead():
    plot = _load("plot")
    shape = dict(K=256, O=64, k=4)  # N = 16
    rows = [
        _row("fold_eager", 1, 20.0, **shape), _row("ours_op", 1, 10.0, **shape),
        _row("fold_eager", 2, 9.0, **shape), _row("ours_op", 2, 10.0, **shape),
        # A faster peer that is not accurate is nobody's best peer.
        _row("fold_compile", 2, 1.0, rel_err_fp64=1e-4, **shape),
    ]
    summary = "\n".join(plot.grid_summary(rows))
    assert "2 of 2 points timed" in summary
    assert "geometric-mean speedup **1.34x**" in summary  # sqrt(2.0 * 0.9)
    assert "worst: K = 256, N = 16, B = 2: 0.90x (ours 10.0 us, fold_eager 9.0 us)" in summary
    assert "Ours not ahead: K = 256, N = 16, B = 2: 0.90x" in summary


@pytest.mark.parametrize("broken", [False, True], ids=["ours-accurate", "ours-wrong"])
def test_the_kernelbench_timing_runs_both_models_and_checks_ours(broken, tmp_path, monkeypatch):
    import fused_pool_gelu

    bench = _load("bench_kernelbench")
    if broken:
        class OffModelNew(fused_pool_gelu.ModelNew):
            def forward(self, x):
                return super().forward(x) * 1.01

        monkeypatch.setattr(fused_pool_gelu, "ModelNew", OffModelNew)
    path = tmp_path / "cpu-kernelbench.json"
    argv = ["--device", "cpu", "-B", "4", "-K", "64", "-O", "64", "-k", "4", "--trials", "3",
            "--warmup", "1", "--rep", "5", "--out", str(path)]
    assert bench.main(argv) == (1 if broken else 0)
    data = json.loads(path.read_text())
    assert {(r["impl"], r["grad"]) for r in data["rows"]} == {
        (impl, grad) for impl in ("Model", "ModelNew") for grad in ("enabled", "no_grad")}
    assert all(r["kernelbench_ms"]["num_trials"] == 3 for r in data["rows"])
    assert data["correct_trials"] == (0 if broken else bench.KB_CORRECT_TRIALS)
    assert set(data["speedups"]) == {"enabled", "no_grad"}
    assert '"excessive speedup" flag' in path.with_suffix(".md").read_text()


def test_the_paths_benchmark_times_model_new_eager_grad_enabled_and_exported(tmp_path):
    _load("bench_forward")  # bench_paths imports it as a top-level module
    paths = _load("bench_paths")
    path = tmp_path / "cpu-paths.json"
    impls = ["ours_model", "ours_op", "ours_model_grad", "model_export"]
    argv = ["--device", "cpu", "-K", "32", "-O", "16", "-k", "4", "--batches", "1", "5",
            "--impls", *impls, "--warmup", "1", "--rep", "5", "--out", str(path)]
    assert paths.main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {(r["impl"], r["B"]) for r in rows} == {(i, b) for i in impls for b in (1, 5)}
    assert all(common.is_accurate(r) and r["median_us"] > 0 for r in rows), rows
