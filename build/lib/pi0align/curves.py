"""Loss curves of runs side by side, as data (the notebook's and `pi0align curves`' loader).

    from pi0align.curves import load_runs, compare_curves
    frame = load_runs(["outputs/gpu-train.log", "dumps/npu-run"])   # run, step, loss, grad_norm, lr, …, window
    print(compare_curves(frame, tolerance=0.01).differences)
"""

from pi0align.runs.curves import COLUMNS, TOLERANCE, CurveComparison, CurveDifference, compare_curves, load_runs

__all__ = ["COLUMNS", "TOLERANCE", "CurveComparison", "CurveDifference", "compare_curves", "load_runs"]
