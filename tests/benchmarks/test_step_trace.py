"""benchmarks/step_trace.py: each copy goes to the lane of its own direction."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import step_trace  # noqa: E402


class _Event:
    def __init__(self, name, stream, start, dur, nbytes=0, device="DeviceType.CUDA"):
        self._name, self._stream, self._start, self._dur, self._nbytes, self._dev = (
            name,
            stream,
            start,
            dur,
            nbytes,
            device,
        )

    def name(self):
        return self._name

    def device_type(self):
        return self._dev

    def start_ns(self):
        return self._start

    def duration_ns(self):
        return self._dur

    def device_resource_id(self):
        return self._stream

    def nbytes(self):
        return self._nbytes

    def is_user_annotation(self):
        return False


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
