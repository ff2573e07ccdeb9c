"""The benchmarks' roofline helpers: the bandwidth probe keeps the best of its samples, and the
decode line reports both bandwidths."""

from __future__ import annotations

import pytest

from ember_testing.roofline import BandwidthProbe, decode_roofline, read_bandwidth


def test_probe_keeps_the_best_sample_of_each_bandwidth():
    probe = BandwidthProbe(elements=1 << 16, repeats=2)
    samples = [probe.sample() for _ in range(3)]
    assert probe.triad == max(triad for triad, _ in samples) > 0
    assert probe.read == max(read for _, read in samples) > 0


def test_read_bandwidth_is_bytes_over_seconds():
    assert read_bandwidth(elements=1 << 16, repeats=2) > 0


def test_decode_line_against_triad_and_read():
    # 10 tok/s of 1 GB each: 10 GB/s, half of a 20 GB/s triad, a quarter of a 40 GB/s read
    line = decode_roofline(10.0, 1e9, 20e9, read=40e9)
    assert "10.0 GB/s" in line and "roofline   20.0 tok/s" in line
    assert " 50.0% of it" in line and "25.0% of the read bandwidth" in line
    assert "read bandwidth" not in decode_roofline(10.0, 1e9, 20e9)


@pytest.mark.parametrize("read", [None, 40e9])
def test_decode_line_percent_of_roofline(read):
    assert "100.0% of it" in decode_roofline(20.0, 1e9, 20e9, read)
