"""A real two-process training job on this machine: jax.distributed over 127.0.0.1, CPU collectives
(gloo), 4 simulated devices per process, one (2, 2, 2) mesh spanning both; killed, resumed, exported."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import requires_smollm2
from tests.test_train import losses

pytestmark = pytest.mark.slow  # two training processes, killed and resumed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(workdir, process_id, num_processes, port, kill_at, log):
    devices = 8 // num_processes
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([sys.executable, "-m", "tests.distributed_worker", str(workdir), str(process_id),
                             str(num_processes), str(port), str(kill_at)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)


def job(workdir, num_processes, kill_at=0):
    """Runs the processes to their end; (exit code, the end of its stderr) of each."""
    port = free_port()
    logs = [open(f"{workdir}.{i}.{kill_at}.log", "w+") for i in range(num_processes)]
    procs = [start(workdir, i, num_processes, port, kill_at, log) for i, log in enumerate(logs)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for code, log in zip(codes, logs):
        log.seek(0)
        results.append((code, log.read()[-3000:]))
        log.close()
    return results


@requires_smollm2
def test_two_processes_train_kill_resume_and_equal_one_process_on_eight_devices(tmp_path):
    alone = job(tmp_path / "one", 1)
    assert alone[0][0] == 0, alone[0][1]

    killed = job(tmp_path / "two", 2, kill_at=5)  # both die asking for step 5's batch, after step 4's save
    assert all(code == -9 for code, _ in killed), [err for _, err in killed]
    resumed = job(tmp_path / "two", 2)
    assert all(code == 0 for code, _ in resumed), [err for _, err in resumed]

    expected, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [step for step, *_ in got] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(np.array(got)[:, 1:], np.array(expected)[:, 1:], rtol=1e-5, atol=1e-5)

    # Each host read only its own half of each global batch: its rows, in order, and nothing else.
    single = json.loads((tmp_path / "one" / "host0.json").read_text())["tokens"]
    hosts = [json.loads((tmp_path / "two" / f"host{i}.json").read_text()) for i in range(2)]
    begin = hosts[0]["start"]
    assert begin in (2, 4) and hosts[1]["start"] == begin  # resumed from a checkpoint written before the kill
    for i, host in enumerate(hosts):
        assert [np.shape(batch) for batch in host["tokens"]] == [(4, 64)] * (6 - begin)
        assert host["tokens"] == [batch[4 * i: 4 * (i + 1)] for batch in single[begin:]]

    # The HF export of parameters sharded across the two processes equals the single process's export.
    exported = [load_file(str(tmp_path / run / "hf" / "model.safetensors")) for run in ("one", "two")]
    assert exported[0].keys() == exported[1].keys()
    for name in exported[0]:
        np.testing.assert_allclose(exported[1][name], exported[0][name], atol=1e-5, rtol=1e-5, err_msg=name)
