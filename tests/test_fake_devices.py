"""The background probe queue (tests/fake_devices.py): a queued probe's JSON comes back as a
foreground run's would, a probe the queue never reached is started on demand, and a failing
probe's stderr reaches its test (the control: the queue cannot hide a failure)."""

import pytest

from tests.fake_devices import ProbeQueue


def _script(path, body):
    path.write_text("import json, os, sys\n" + body)
    return str(path)  # absolute: tests/<script> joins to it as is


def test_queued_on_demand_and_failing_probes(tmp_path):
    echo = _script(tmp_path / "echo.py",
                   "print(json.dumps([sys.argv[1:], os.environ['XLA_FLAGS']]))")
    fail = _script(tmp_path / "fail.py", "sys.exit('probe broke: ' + sys.argv[1])")
    queue = ProbeQueue([(echo, ("a",), 2), (fail, ("x",), 1)])
    try:
        args, flags = queue.take((echo, ("a",), 2)).result()
        assert args == ["a"] and "--xla_force_host_platform_device_count=2" in flags
        assert queue.take((echo, ("b",), 3)).result()[0] == ["b"]  # never queued: started now
        with pytest.raises(AssertionError, match="probe broke: x"):
            queue.take((fail, ("x",), 1)).result()
    finally:
        queue.close()
