"""Host streams: RAW/WAR ordering by events, an injected slow copy thread, failures surfaced."""

import ctypes
import time

import pytest

from dwdp_runtime.streams import CopyStreamError, HostStreams
from tests.timing import hold


def _buf(n, fill):
    b = (ctypes.c_uint8 * n)()
    ctypes.memset(b, fill, n)
    return b


def test_compute_waits_for_a_slow_copy():
    st = HostStreams(copy_delay_s=0.3)
    src, dst = _buf(1 << 16, 7), _buf(1 << 16, 0)
    ev = st.new_event()
    st.wait_compute(ev)  # a new event counts as signalled
    t0 = time.perf_counter()
    st.enqueue_copies(st.compile([(ctypes.addressof(dst), ctypes.addressof(src), 1 << 16)]))
    st.record_copy(ev)
    assert dst[100] == 0  # still in flight (0.3 s delay)
    st.wait_compute(ev)
    assert time.perf_counter() - t0 >= 0.29 and bytes(dst) == bytes(src)
    assert st.stats["wait_s"] > 0.2
    st.close()


def test_copy_waits_for_consume_event():
    st = HostStreams()
    consume = st.new_event()
    # pretend the compute side has not finished reading: record a pending completion by hand
    with consume.cond:
        consume.recorded += 1
    src, dst = _buf(64, 9), _buf(64, 0)
    st.wait_copy(consume)
    st.enqueue_copies(st.compile([(ctypes.addressof(dst), ctypes.addressof(src), 64)]))
    hold(0.2, "a window in which the copy must stay blocked")
    assert dst[0] == 0  # WAR: blocked behind the consume event
    st.record_compute(consume)
    st.synchronize()
    assert dst[0] == 9
    st.close()


def test_copy_failure_is_raised_on_compute_side():
    st = HostStreams()
    ev = st.new_event()
    st._ops.put(("copy", "not-a-batch", 0))  # a corrupt op kills the copy thread's batch
    st.record_copy(ev)
    with pytest.raises(CopyStreamError, match="copy stream failed"):
        st.wait_compute(ev)
    st.close()


def test_stall_is_bounded():
    st = HostStreams(stall_timeout_s=0.2)
    blocker = st.new_event()
    with blocker.cond:
        blocker.recorded += 1  # never completed
    ev = st.new_event()
    st.wait_copy(blocker)
    st.record_copy(ev)
    with pytest.raises(CopyStreamError, match="stalled"):
        st.wait_compute(ev)
    st.record_compute(blocker)
    st.close()
