"""benchmarks/step_trace.py: each copy goes to the lane of its own direction."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import step_trace  # noqa: E402


class _Event:
    """The part of a kineto event that spans_from_events reads."""

    def __init__(self, name, stream, start, dur, nbytes=0):
        self.name = lambda: name
        self.device_type = lambda: "DeviceType.CUDA"
        self.start_ns = lambda: start
        self.duration_ns = lambda: dur
        self.device_resource_id = lambda: stream
        self.nbytes = lambda: nbytes
        self.is_user_annotation = lambda: False


def test_a_stream_that_uploads_metadata_first_still_shows_its_copies_out_as_d2h():
    events = [
        _Event("gemm_kernel", 7, 0, 1000),  # the compute stream
        _Event("Memcpy HtoD (Pageable -> Device)", 9, 100, 10, 64),  # a digest's metadata first
        _Event("Memcpy DtoH (Device -> Pinned)", 9, 200, 500, 1 << 30),  # then the copy out
        _Event("Memcpy HtoD (Pinned -> Device)", 11, 300, 400, 1 << 30),  # a prefetch in
    ]
    spans = step_trace.spans_from_events(events)
    lanes = {sp.name: sp.lane for sp in spans}
    assert lanes["gemm_kernel"] == "compute"
    assert lanes["Memcpy DtoH (Device -> Pinned)"] == "d2h"
    assert lanes["Memcpy HtoD (Pageable -> Device)"] == "h2d"
    assert lanes["Memcpy HtoD (Pinned -> Device)"] == "h2d"
