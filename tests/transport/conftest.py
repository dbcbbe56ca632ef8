"""Every transport test runs twice: with the C allreduce loop and with the Python loop.

The two loops speak the same wire and must behave alike in every case these tests check
(results, timeouts, blame, aborts, leaks). Subprocess ranks inherit the choice through the
environment. Without the built extension the "native" run is skipped with that reason;
test_transport_native.py fails instead where a C compiler exists but the extension is missing.
"""

from __future__ import annotations

import pytest

from p2pft.transport import native


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # A module that compares the loops itself sets OWN_RING_LOOP = True and runs once.
    if "ring_loop" in metafunc.fixturenames and not getattr(metafunc.module, "OWN_RING_LOOP", False):
        metafunc.parametrize("ring_loop", ["native", "python"], indirect=True)


@pytest.fixture(autouse=True)
def ring_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    which = getattr(request, "param", "default")
    if which == "native":
        if native._MODULE is None:
            pytest.skip("the C ring loop (transport/_ringloop.c) is not built")
        monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    elif which == "python":
        monkeypatch.setenv(native.NATIVE_ENV, "0")
    return which
