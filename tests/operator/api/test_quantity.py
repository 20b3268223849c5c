"""Kubernetes quantities: the canonical string kube-apiserver stores, from its documented behaviour
(apimachinery's resource.Quantity: suffix family kept, decimal exponents in multiples of 3, binary
suffixes only for whole multiples of 1024, nano precision rounded up)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kvasir.operator.api.quantity import QuantityError, canonical_quantity, parse_quantity

# (input, what the API server stores); cases from Kubernetes' own quantity tests and docs.
CANONICAL = [
    ("0.5", "500m"),
    (0.5, "500m"),
    (1, "1"),
    ("1000m", "1"),
    ("1500m", "1500m"),
    ("1.5", "1500m"),
    ("100m", "100m"),
    ("0.1", "100m"),
    ("1200", "1200"),
    ("1000", "1k"),
    ("16000000000", "16G"),
    ("16G", "16G"),
    ("1Gi", "1Gi"),
    ("1024Mi", "1Gi"),
    ("1.5Gi", "1536Mi"),
    ("0.5Ki", "512"),
    ("1.5Ki", "1536"),
    ("1023Ki", "1023Ki"),
    ("1Ki", "1Ki"),
    ("0", "0"),
    ("0Gi", "0"),
    ("100u", "100u"),
    ("0.0000000001", "1n"),  # below nano precision: rounded up
    ("1e3", "1e3"),
    ("12e6", "12e6"),
    ("2k", "2k"),
]


@pytest.mark.parametrize(("value", "stored"), CANONICAL, ids=[str(c[0]) for c in CANONICAL])
def test_canonical_form(value, stored) -> None:
    assert canonical_quantity(value) == stored
    assert canonical_quantity(stored) == stored  # idempotent: what is stored compares equal


@pytest.mark.parametrize(
    "value", ["lots", "16GB", "1.2.3", "", "Gi", "1 Gi", "0x10", "1e", True, float("nan")]
)
def test_not_quantities(value) -> None:
    with pytest.raises(QuantityError):
        canonical_quantity(value)


def test_values() -> None:
    assert parse_quantity("500m") == Decimal("0.5")
    assert parse_quantity("2Gi") == 2 * 1024**3
    assert parse_quantity("1e3") == 1000
