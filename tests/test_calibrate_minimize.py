"""The fitter's one-constant search finds the better of two minima (planner.calibrate.minimize_1d), and a
measured prior decides between near-equal ones (planner.calibrate.measured_priors)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from planner import calibrate
from planner.calibrate import minimize_1d


def two_minima(x: float) -> float:
    """A shallow minimum at 0.42 (value 0.001) and the global one at 0.67 (value 0), as the capped
    objective had for the FP8 efficiency in the fold without MLPerf."""
    return min((x - 0.42) ** 2 + 0.001, (x - 0.67) ** 2)


def golden_only(f: Callable[[float], float], lo: float, hi: float, tol: float) -> float:
    phi = (5 ** 0.5 - 1) / 2
    x1, x2 = hi - phi * (hi - lo), lo + phi * (hi - lo)
    while hi - lo > tol:
        if f(x1) < f(x2):
            hi, x2 = x2, x1
            x1 = hi - phi * (hi - lo)
        else:
            lo, x1 = x1, x2
            x2 = lo + phi * (hi - lo)
    return (lo + hi) / 2


def test_golden_section_alone_keeps_the_worse_minimum():
    assert golden_only(two_minima, 0.15, 0.90, 1e-4) == pytest.approx(0.42, abs=1e-3)


def test_the_scan_first_finds_the_global_minimum():
    assert minimize_1d(two_minima, 0.15, 0.90, 1e-4) == pytest.approx(0.67, abs=1e-3)


def test_a_minimum_at_the_bound():
    assert minimize_1d(lambda x: x, 0.0, 1.0, 1e-4) == pytest.approx(0.0, abs=1e-3)
    assert minimize_1d(lambda x: -x, 0.0, 1.0, 1e-4) == pytest.approx(1.0, abs=1e-3)



def narrow_and_wide(x: float) -> float:
    """Hopper's attention efficiency in the fold without MosaicML (2026-12-07), as measured there: a narrow
    global minimum at 0.195 (0.107), a wide one at 0.41 (0.110)."""
    return min(0.107 + 8.0 * (x - 0.195) ** 2, 0.110 + 0.05 * (x - 0.41) ** 2)


def test_a_narrow_minimum_between_coarse_scan_points_is_found():
    coarse = [0.15 + 0.75 * i / 4 for i in range(5)]  # the 5-point scan before 2026-12-07
    best = min(coarse, key=narrow_and_wide)
    assert golden_only(narrow_and_wide, best - 0.1875, best + 0.1875, 0.0075) == pytest.approx(0.41, abs=0.01)
    assert minimize_1d(narrow_and_wide, 0.15, 0.90, 0.0075) == pytest.approx(0.195, abs=0.01)


def test_the_measured_priors_are_the_shipped_h200_profiles_best_gemms():
    priors = calibrate.measured_priors()
    assert priors[("fp8_matmul_efficiency", "hopper")].value == pytest.approx(1381.4517686954723 / 1978.0)
    assert priors[("matmul_efficiency", "hopper")].value == pytest.approx(746.9389819897478 / 989.0)
    assert not any(family == "a100" for _, family in priors)  # no A100 was measured


def test_a_prior_weighs_as_prior_rows_of_its_log_distance():
    key = ("fp8_matmul_efficiency", "hopper")
    prior = {key: calibrate.Prior(0.7, "by hand")}
    # no rows: the objective is the prior's own term, |ln(0.5 / 0.7)| = 0.3365
    assert calibrate.objective([], {key: 0.5}, prior) == pytest.approx(0.33647, abs=1e-5)
    # a constant outside the values pays nothing
    assert calibrate.objective([], {("matmul_efficiency", "a100"): 0.5}, prior) == 0.0


def test_the_prior_decides_between_near_equal_minima():
    """The fold without MLPerf: two minima of the FP8 efficiency 0.0014 apart in the mean over ~40 rows;
    two rows of prior at the measured 0.70 pick the one beside it."""
    rows = 40

    def fold(x: float) -> float:
        data = rows * (min((x - 0.42) ** 2, (x - 0.67) ** 2 + 0.0014))
        return (data + calibrate.PRIOR_ROWS * abs(math.log(x / 0.70))) / (rows + calibrate.PRIOR_ROWS)

    assert minimize_1d(lambda x: min((x - 0.42) ** 2, (x - 0.67) ** 2 + 0.0014), 0.15, 0.90, 1e-4) == \
        pytest.approx(0.42, abs=1e-3)
    assert minimize_1d(fold, 0.15, 0.90, 1e-4) > 0.6
