"""Constant-time "does this payload see this request?" for the kmock emulator.

kmock picks a payload for each request by asking `request in payload_source`, and answers that by
re-filtering the whole request log until it meets the request itself: every request costs
O(requests so far x payloads), and a test's run is quadratic in its length. Profiled on
tests/operator/test_rbac.py's full run: 96% of its time went there (1,700 requests, 17,000
membership checks, 68 million criteria calls).

For the views whose membership depends on the request alone, a filter by criteria and a priority
hint, the same answer comes from one criteria call and the source's own membership. Views whose
answer depends on the other requests (slices, groups, exclusions) keep kmock's scan.
"""

from __future__ import annotations

from typing import Any


def install() -> None:
    """Patch kmock's Filter and Priority views; a no-op where kmock's internals differ."""
    try:
        from kmock._internal import dsl, rendering
    except ImportError:
        return
    filter_view, priority_view = getattr(dsl, "Filter", None), getattr(dsl, "Priority", None)
    request_type = getattr(rendering, "Request", None)
    if filter_view is None or priority_view is None or request_type is None:
        return
    if getattr(filter_view, "_kvasir_membership", False):
        return
    scan = filter_view.__contains__

    def filter_contains(self: Any, item: Any) -> bool:
        if isinstance(item, request_type):
            return bool(self.criteria(item)) and item in self._source
        return bool(scan(self, item))

    def priority_contains(self: Any, item: Any) -> bool:
        if isinstance(item, request_type):
            return item in self._source
        return bool(scan(self, item))

    filter_view.__contains__ = filter_contains
    priority_view.__contains__ = priority_contains
    filter_view._kvasir_membership = True
