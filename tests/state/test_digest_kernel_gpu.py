"""The one-kernel digest (tidal.state.digest_kernel) against the per-storage reference."""

import pytest
import torch

from tidal.state import digest_kernel
from tidal.state.digest import digest, digest_many

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _triton():
    if not digest_kernel.available():
        pytest.skip("Triton is not installed (the per-storage path serves)")


def _sizes():
    words = digest_kernel.CHUNK_WORDS
    rows = 4096 * 8  # bytes in one row of column weights
    return [0, 1, 7, 8, 9, 4095 * 8, rows - 1, rows, rows + 5, 3 * rows + 8 * 17 + 3, 2 * words * 8 + 8 * 4099 + 5]


def test_one_kernel_equals_the_reference_for_every_size():
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g) for n in _sizes()]
    got = digest_many(xs).tolist()
    want = [int(digest(x)) for x in xs]
    assert got == want
    assert digest_many([x.untyped_storage() for x in xs]).tolist() == want  # as the store passes them
    # "sampled": the storages over 4096 words sampled by the second kernel, the others whole.
    sampled = [int(digest(x, "sampled")) for x in xs]
    assert digest_many(xs, "sampled").tolist() == sampled
    assert sum(s != f for s, f in zip(sampled, want)) >= 2  # some were really sampled
    assert len(set(want)) == len(want)
    # The host computes the same value (verify compares digests of host and device bytes).
    assert [int(digest(x.cpu())) for x in xs] == want


def test_one_kernel_sees_any_changed_word():
    x = torch.randint(0, 256, (3 * digest_kernel.CHUNK_WORDS * 8 + 11,), dtype=torch.uint8, device="cuda")
    base = int(digest_many([x])[0])
    for pos in (0, 8 * digest_kernel.CHUNK_WORDS, x.numel() - 12, x.numel() - 1):  # chunk edges, last row, tail
        y = x.clone()
        y[pos] ^= 1
        assert int(digest_many([y])[0]) != base, pos
    y = x.clone()
    y[:8], y[8:16] = x[8:16], x[:8]  # two words swapped
    assert int(digest_many([y])[0]) != base


def test_queued_behind_the_writes_on_the_current_stream():
    """The digest reads what the stream's queued kernels wrote, not what was there when the
    host queued it (the bytes are written after a long GPU sleep)."""
    x = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    want = int(digest(torch.ones_like(x)))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of queued work before the write
    x.fill_(1)
    assert int(digest_many([x])[0]) == want


def test_one_compiled_kernel_serves_every_count_of_storages_and_chunks():
    """Compiling a kernel costs the host seconds inside a transition: the metadata the kernels
    read starts 16-byte aligned whatever the counts, so Triton never specialises them anew."""
    g = torch.Generator(device="cuda").manual_seed(1)
    big = 3 * digest_kernel.CHUNK_WORDS * 8 + 8 * 4099  # several chunks, sampled too
    full, sampled = digest_kernel._kernel()
    for k in range(1, 8):
        xs = [
            torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
            for n in [big] * k + [64] * (k % 3)
        ]
        assert digest_many(xs).tolist() == [int(digest(x)) for x in xs]
        assert digest_many(xs, "sampled").tolist() == [int(digest(x, "sampled")) for x in xs]
    torch.cuda.synchronize()
    for kernel in (full, sampled):
        assert _compiled(kernel) == 1, kernel


def _compiled(kernel) -> int:
    """How many kernels a Triton JITFunction has compiled (its in-memory cache, per device:
    a dict, or a tuple whose first item is that dict)."""
    caches = getattr(kernel, "device_caches", None) or getattr(kernel, "cache")
    total = 0
    for per_device in caches.values():
        total += len(per_device[0] if isinstance(per_device, tuple) else per_device)
    return total
