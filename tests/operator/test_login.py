"""The operator's in-cluster login dials the API server at the address the kubelet puts in every pod
(KUBERNETES_SERVICE_HOST/PORT), not kopf's DNS name, so it works on a node without cluster DNS."""

from __future__ import annotations

import kopf

from kvasir.operator.handlers import in_cluster_address

KOPF = kopf.ConnectionInfo(server="https://kubernetes.default.svc", token="t", ca_path="/ca.crt")


def test_the_service_variables_name_the_server() -> None:
    info = in_cluster_address(KOPF, {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert info.server == "https://10.0.0.1:443"
    assert (info.token, info.ca_path) == ("t", "/ca.crt")


def test_an_ipv6_service_address_is_bracketed() -> None:
    info = in_cluster_address(KOPF, {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"})
    assert info.server == "https://[fd00::1]:443"


def test_without_both_variables_kopf_s_address_stays() -> None:
    assert in_cluster_address(KOPF, {}).server == "https://kubernetes.default.svc"
    assert in_cluster_address(KOPF, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}).server == KOPF.server
