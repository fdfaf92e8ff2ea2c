"""Where a remote model may not connect: link-local addresses and cloud metadata services,
however their address is spelled (store/remoteaddr.py), and the keys a Modelfile may name
(config.remote_keys)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from llmrun import config
from llmrun.store.remoteaddr import address_refusal, host_refusal, literal_address

METADATA = ipaddress.ip_address("169.254.169.254")


@pytest.mark.parametrize("host", [
    "169.254.169.254", "169.254.169.254.",  # the dotted quad, and with the root's dot
    "2852039166", "0xa9fea9fe", "0251.0376.0251.0376", "169.254.43518",  # inet_aton's forms
    "0xA9.0xFE.0xA9.0xFE",
    "::ffff:169.254.169.254", "[::ffff:a9fe:a9fe]",  # IPv4-mapped IPv6
    "::169.254.169.254",  # IPv4-compatible IPv6 (deprecated, still routed by some stacks)
    "64:ff9b::a9fe:a9fe",  # NAT64's well-known prefix
    "2002:a9fe:a9fe::1",  # 6to4
])
def test_every_spelling_of_the_metadata_address_is_refused(host: str) -> None:
    assert literal_address(host) is not None
    reason = host_refusal(host)
    assert reason is not None and "metadata" in reason


@pytest.mark.parametrize("host", [
    "169.254.0.1", "169.254.255.255", "fe80::1", "[fe80::1%eth0]", "febf:ffff::1",
    "::ffff:169.254.1.1",
])
def test_link_local_addresses_are_refused(host: str) -> None:
    reason = host_refusal(host)
    assert reason is not None and "link-local" in reason


@pytest.mark.parametrize("host", [
    "fd00:ec2::254", "[fd20:ce::254]", "100.100.100.200",  # outside the link-local ranges
    "metadata.google.internal", "METADATA.GOOGLE.INTERNAL.", "metadata", "instance-data",
])
def test_metadata_services_outside_link_local_are_refused(host: str) -> None:
    reason = host_refusal(host)
    assert reason is not None and "metadata" in reason


@pytest.mark.parametrize("host", [
    "127.0.0.1", "localhost", "::1", "10.0.0.2", "192.168.1.20", "172.16.0.1", "8.8.8.8",
    "gpu-box.internal", "vllm.example.com", "fd00::1", "169.253.255.255", "169.255.0.0",
    "cafe", "face.b00c", "2001:db8::1", "0x7f000001",
])
def test_other_hosts_are_left_to_the_owner(host: str) -> None:
    assert host_refusal(host) is None


def test_address_refusal_unwraps_ipv6() -> None:
    assert address_refusal(METADATA) is not None
    assert address_refusal(ipaddress.ip_address("::ffff:10.0.0.1")) is None
    assert address_refusal(ipaddress.ip_address("::")) is None  # (not "compatible" 0.0.0.0)
    assert address_refusal(ipaddress.ip_address("::1")) is None


def test_remote_keys_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert config.parse_remote_keys("") == {}
    assert config.parse_remote_keys(" vllm = VLLM_KEY , openai=OPENAI_API_KEY,") == {
        "vllm": "VLLM_KEY", "openai": "OPENAI_API_KEY"}
    for bad in ("vllm", "vllm=", "=X", "vllm=1BAD", "a b=X", "vllm=X-Y"):
        with pytest.raises(ValueError):
            config.parse_remote_keys(bad)
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    monkeypatch.setenv("LLMRUN_REMOTE_KEYS", "vllm=VLLM_KEY,broken")
    assert config.remote_keys() == {}  # a typo sends no key rather than a guess
    monkeypatch.delenv("LLMRUN_REMOTE_KEYS")
    (tmp_path / "config.yaml").write_text("LLMRUN_REMOTE_KEYS:\n  vllm: VLLM_KEY\n  hub: HUB\n")
    config._file_settings.cache_clear()
    try:
        assert config.remote_keys() == {"vllm": "VLLM_KEY", "hub": "HUB"}
        (tmp_path / "config.yaml").write_text("LLMRUN_REMOTE_KEYS: vllm=VLLM_KEY\n")
        config._file_settings.cache_clear()
        assert config.remote_keys() == {"vllm": "VLLM_KEY"}
    finally:
        config._file_settings.cache_clear()
    assert not config.remote_create() and not config.remote_link_local()  # the defaults
