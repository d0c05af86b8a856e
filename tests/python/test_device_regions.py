"""The binding's stream cache of ops on CUDA tensors (spclient._device.Streams),
without a GPU: libspclient's spc_stream_* and torch's streams are played by
fakes, so the cache's decisions are checked here on every machine;
test_cuda.py runs it against a real GPU. The registration cache is
libspclient's own (spc_device_cover): tests/unit/test_devcache.c checks its
decisions over a fake driver, test_device_cover_stub and test_vmm_stub.py over
the stand-in driver and a real spd."""
import ctypes

import pytest

from spclient import _device


# ---------------------------------------------------------------- streams


class FakeStreamLib:
    """spc_stream_* as libspclient answers them; `refuse` makes create fail."""

    def __init__(self, refuse=0):
        self.live, self.next, self.refuse, self.calls = set(), 0x1000, refuse, []

    def spc_stream_create(self, h, cu_stream, s_p):
        if self.refuse:
            return self.refuse
        if len(self.live) >= 32:
            return -305
        self.next += 0x10
        self.live.add(self.next)
        ctypes.cast(s_p, ctypes.POINTER(ctypes.c_void_p))[0] = self.next
        return 0

    def spc_stream_destroy(self, s):
        self.live.remove(s)
        self.calls.append(("destroy", s))
        return 0

    def spc_stream_query(self, s):
        assert s in self.live, "query of a destroyed stream"
        self.calls.append(("query", s))
        return 0

    def spc_last_error(self, h):
        return b"the GPU cannot wait on 64-bit values"


class FakeStream:
    def __init__(self, handle, index=0):
        self.cuda_stream, self.device = handle, type("Dev", (), {"index": index})()


@pytest.fixture
def stream_fakes(monkeypatch):
    import contextlib
    import types
    lib = FakeStreamLib()
    monkeypatch.setattr(_device, "lib", lib)
    monkeypatch.setattr(_device._lib, "has_streams", True)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(device=lambda d: contextlib.nullcontext()))
    monkeypatch.setattr(_device, "_torch", lambda: fake_torch)
    return lib


def test_one_spc_stream_per_torch_stream(stream_fakes):
    st = _device.Streams(True)
    a, b = st.get(None, FakeStream(0)), st.get(None, FakeStream(0x77))
    assert a != b and st.get(None, FakeStream(0)) == a and len(stream_fakes.live) == 2
    assert st.get(None, FakeStream(0, index=1)) not in (a, b)          # another GPU's default stream


def test_streams_bounded_side_streams_kept(stream_fakes):
    """Past SPC_STREAMS_MAX the least recently used goes, never a pinned side
    stream; a request's check of a destroyed stream asks nothing of it."""
    st = _device.Streams(True)
    side = st.get(None, FakeStream(0x5), pin=True)
    first = st.get(None, FakeStream(0x100))
    for i in range(1, 40):
        st.get(None, FakeStream(0x100 + i))
    assert side in stream_fakes.live and first not in stream_fakes.live and len(st) == 32
    st.check(None, first)
    assert ("query", first) not in stream_fakes.calls


@pytest.mark.parametrize("status", [-5, -201])
def test_no_stream_order_means_host_synchronous(stream_fakes, status):
    stream_fakes.refuse = status
    st = _device.Streams(True)
    assert st.get(None, FakeStream(0)) is None and "64-bit" in st.why_not
    assert _device.Streams(False).get(None, FakeStream(0)) is None
