"""The digest kernels' metadata layout (tidal.state.digest_kernel), on the CPU."""

import torch

from tidal.state.digest_kernel import _packed


def test_packed_columns_start_16_byte_aligned_and_hold_their_values():
    for lengths in [(1, 1, 1, 1), (3, 3, 5, 7), (2, 5, 0, 9), (4, 4, 4, 4)]:
        columns = [[100 * c + i for i in range(n)] for c, n in enumerate(lengths)]
        got = _packed(columns, torch.device("cpu"))
        base = got[0].data_ptr() - got[0].storage_offset() * 8
        assert [t.tolist() for t in got] == columns
        assert all((t.data_ptr() - base) % 16 == 0 for t in got), lengths
