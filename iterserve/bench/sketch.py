"""A mergeable quantile sketch with a stated relative error (DDSketch's log buckets, on numpy).

Why: the report's percentiles used to come from every request's record, which for a day of traffic
is tens of millions of records. Log-spaced buckets whose edges grow by gamma = (1 + a) / (1 - a)
hold each value within a relative error `a` of its bucket's representative 2 gamma^i / (gamma + 1)
(Masson, Rim and Lee, "DDSketch", VLDB 2019), in a fixed array whatever the count; two sketches of
the same `a` merge by adding their counts. Quantiles interpolate between the ranks below and above,
as `np.percentile` does, so each is within `a` (relative) of `np.percentile` over the same values.
Values below `min_value` (zero included) share one bucket reported as 0, an absolute error below
`min_value`; values above `max_value` are clamped into the last bucket (outside the bound).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

DEFAULT_RELATIVE_ERROR = 0.005
MIN_VALUE = 1e-7  # seconds: latencies below 0.1 us are reported as 0
MAX_VALUE = 1e7  # seconds: about 4 months


class QuantileSketch:
    """Counts of values in log-spaced buckets; exact count, sum, min and max besides."""

    def __init__(self, relative_error: float = DEFAULT_RELATIVE_ERROR, min_value: float = MIN_VALUE,
                 max_value: float = MAX_VALUE) -> None:
        if not 0 < relative_error < 1:
            raise ValueError(f"relative_error must be in (0, 1), got {relative_error}")
        self.relative_error = relative_error
        self.min_value, self.max_value = min_value, max_value
        self.gamma = (1 + relative_error) / (1 - relative_error)
        self._log_gamma = math.log(self.gamma)
        self._offset = math.ceil(math.log(min_value) / self._log_gamma)
        size = math.ceil(math.log(max_value) / self._log_gamma) - self._offset + 2
        self.counts = np.zeros(size, dtype=np.int64)  # [0]: values below min_value
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf

    def _bucket(self, value: float) -> int:
        if value < self.min_value:
            return 0
        i = math.ceil(math.log(value) / self._log_gamma) - self._offset + 1
        return min(max(i, 1), self.counts.size - 1)

    def add(self, value: float) -> None:
        self.counts[self._bucket(value)] += 1
        self.count += 1
        self.sum += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)

    def add_many(self, values: Iterable[float] | np.ndarray) -> None:
        """Adds many at once (a request's inter-token gaps): one numpy pass instead of a loop."""
        v = np.asarray(values, dtype=float)
        if v.size == 0:
            return
        small = v < self.min_value
        idx = np.zeros(v.size, dtype=np.int64)
        big = v[~small]
        idx[~small] = np.clip(np.ceil(np.log(big) / self._log_gamma).astype(np.int64) - self._offset + 1,
                              1, self.counts.size - 1)
        self.counts += np.bincount(idx, minlength=self.counts.size)
        self.count += int(v.size)
        self.sum += float(v.sum())
        self.min = min(self.min, float(v.min()))
        self.max = max(self.max, float(v.max()))

    def merge(self, other: QuantileSketch) -> None:
        """Adds another sketch's values (same relative error and range): shards or replicas combine."""
        if (other.relative_error, other.min_value, other.max_value) != (self.relative_error, self.min_value,
                                                                        self.max_value):
            raise ValueError("only sketches of the same relative error and range merge")
        self.counts += other.counts
        self.count += other.count
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    def _value_at_rank(self, cumulative: np.ndarray, rank: int) -> float:
        i = int(np.searchsorted(cumulative, rank, side="right"))
        if i == 0:
            return 0.0
        value = 2 * self.gamma ** (i - 1 + self._offset) / (self.gamma + 1)
        return min(max(value, self.min), self.max)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 <= q <= 1) with np.percentile's linear interpolation; None when empty."""
        if self.count == 0:
            return None
        cumulative = np.cumsum(self.counts)
        pos = q * (self.count - 1)
        lo, frac = int(math.floor(pos)), pos - math.floor(pos)
        low = self._value_at_rank(cumulative, lo)
        if frac == 0:
            return low
        return low + frac * (self._value_at_rank(cumulative, lo + 1) - low)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None
