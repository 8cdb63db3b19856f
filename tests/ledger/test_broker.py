"""The embedded broker (ledger/broker.py): no process reads a message or a table of
bindings that another is still writing, so none stops on one, and a message taken by a
process killed before it acknowledged it is delivered again: nothing is lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from typing import Any

import psutil
import pytest
from kombu import Connection
from kombu.transport import filesystem, virtual

from ledger import broker
from tests.conftest import ROOT, wait_for


def folders(root: Path) -> dict[str, Any]:
    (root / "queue").mkdir(exist_ok=True)
    (root / "control").mkdir(exist_ok=True)
    queue = str(root / "queue")
    return {
        "data_folder_in": queue,
        "data_folder_out": queue,
        "control_folder": str(root / "control"),
        "held_folder": str(root / "held"),
    }


def held_files(root: Path) -> list[str]:
    """The messages taken and not acknowledged, in every process's folder."""
    return sorted(file.name for file in (root / "held").glob("*/*.msg"))


@pytest.fixture(autouse=True)
def bindings_of_this_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kombu remembers the queues bound in a process in its transport class, and would
    not bind them in the next test's folders."""
    monkeypatch.setattr(broker.Transport, "global_state", virtual.BrokerState())


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[broker.Channel]:
    with Connection(transport=broker.Transport, transport_options=folders(tmp_path)) as connection:
        yield connection.default_channel


def test_a_message_being_written_is_not_there_yet_then_whole(
    channel: broker.Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen_while_written = []

    def replace_once_a_worker_has_looked(src: str, dst: str) -> None:
        try:
            seen_while_written.append(channel._get("tasks"))
        except Empty:
            seen_while_written.append(None)
        real_replace(src, dst)

    real_replace = broker.os.replace
    monkeypatch.setattr(broker.os, "replace", replace_once_a_worker_has_looked)
    channel._put("tasks", {"body": "verify the next slice"})

    assert seen_while_written == [None]
    assert channel._get("tasks") == {"body": "verify the next slice"}
    with pytest.raises(Empty):
        channel._get("tasks")


def test_kombus_own_transport_still_hands_a_worker_an_empty_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why ledger/broker.py exists (celery/kombu#1551). When this fails, Kombu writes a
    message whole before a worker can see it, and the module can go."""
    with Connection(transport=filesystem.Transport, transport_options=folders(tmp_path)) as c:
        channel = c.default_channel
        real_dumps = filesystem.dumps

        def dumps_once_a_worker_has_looked(payload: Any) -> str:
            channel._get("tasks")
            return real_dumps(payload)

        monkeypatch.setattr(filesystem, "dumps", dumps_once_a_worker_has_looked)
        with pytest.raises(json.JSONDecodeError):
            channel._put("tasks", {"body": "verify the next slice"})


def test_a_table_of_bindings_just_created_reads_as_none_yet_and_takes_one(
    channel: broker.Channel, tmp_path: Path
) -> None:
    # Created by a process that declared the queue and has not written the table yet.
    (tmp_path / "control" / "tasks.exchange").touch()
    assert channel.get_table("tasks") == []

    channel._queue_bind("tasks", "tasks", "", "tasks")
    channel._queue_bind("tasks", "tasks", "", "tasks")  # declared again: no change
    assert channel.get_table("tasks") == [("tasks", "", "tasks")]
    channel._delete("tasks", "tasks", "tasks", "")
    assert channel.get_table("tasks") == []


def test_kombus_own_transport_still_reads_an_empty_table_of_bindings(tmp_path: Path) -> None:
    """When this fails, Kombu reads a table just created, and writes one, under its
    lock, and ledger/broker.py can leave tables to it."""
    with Connection(transport=filesystem.Transport, transport_options=folders(tmp_path)) as c:
        (tmp_path / "control" / "tasks.exchange").touch()
        with pytest.raises(json.JSONDecodeError):
            c.default_channel.get_table("tasks")
        with pytest.raises(json.JSONDecodeError):
            c.default_channel._queue_bind("tasks", "tasks", "", "tasks")


PRODUCE = """
import json, sys
from kombu import Connection
options = json.loads(sys.argv[1])
with Connection(transport="ledger.broker:Transport", transport_options=options) as c:
    queue = c.SimpleQueue("tasks")
    for n in range(int(sys.argv[3])):
        queue.put({"from": sys.argv[2], "n": n, "padding": "x" * 4000})
"""
# Takes until the queue is empty once the file named second exists: the producers
# are done (however slowly a loaded machine started them).
CONSUME = """
import json, os, sys
from kombu import Connection
options = {**json.loads(sys.argv[1]), "polling_interval": 0}
taken = []
with Connection(transport="ledger.broker:Transport", transport_options=options) as c:
    queue = c.SimpleQueue("tasks")
    while True:
        done = os.path.exists(sys.argv[2])
        try:
            message = queue.get(timeout=0.5)
        except queue.Empty:
            if done:
                break
            continue
        taken.append([message.payload["from"], message.payload["n"]])
        message.ack()
print(json.dumps(taken))
"""


def test_workers_take_every_message_of_busy_producers_once(tmp_path: Path) -> None:
    """Three processes put 500 messages each while two take them as fast as they can,
    all five declaring the queue as they start: with Kombu's own transport, one of the
    takers stopped on an empty message in most runs, and messages were lost; with only
    its messages written whole, a producer stopped on an empty table in one run of 30."""

    def python(code: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(folders(tmp_path)), *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    done = tmp_path / "done"
    takers = [python(CONSUME, str(done)) for _ in range(2)]
    producers = [python(PRODUCE, str(n), "500") for n in range(3)]
    for producer in producers:
        _, err = producer.communicate(timeout=120)
        assert producer.returncode == 0, err
    done.touch()
    taken = []
    for taker in takers:
        out, err = taker.communicate(timeout=120)
        assert taker.returncode == 0, err
        taken += [tuple(message) for message in json.loads(out)]

    assert sorted(taken) == [(str(p), n) for p in range(3) for n in range(500)]


# Takes one message as `sys.argv[2]` says (and forks a child that outlives it, if told
# to), says so, and waits to be killed.
TAKE = """
import json, os, signal, sys
from kombu import Connection
options = json.loads(sys.argv[1])
with Connection(transport="ledger.broker:Transport", transport_options=options) as c:
    queue = c.SimpleQueue("tasks", no_ack=sys.argv[2] == "no_ack")
    message = queue.get(timeout=30)
    if sys.argv[2] == "ack":
        message.ack()
    child = os.fork() if sys.argv[2] == "forks" else None
    if child == 0:
        signal.pause()  # until the test kills it
    print(json.dumps({"payload": message.payload, "child": child}), flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize(
    ("taker", "delivered_again"),
    [("holds", True), ("forks", True), ("ack", False), ("no_ack", False)],
)
def test_a_message_is_delivered_again_when_its_taker_is_killed_before_acknowledging_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taker: str, delivered_again: bool
) -> None:
    """Killed, and not reaped yet (a zombie): what it held and did not acknowledge is
    delivered again, even while a child it forked after taking it runs on."""
    monkeypatch.setattr(broker, "PUT_BACK_EVERY_SECONDS", 0)  # look at every take
    with Connection(transport=broker.Transport, transport_options=folders(tmp_path)) as c:
        c.SimpleQueue("tasks").put("refund 42")
        process = subprocess.Popen(
            [sys.executable, "-c", TAKE, json.dumps(folders(tmp_path)), taker],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        child = None
        try:
            assert process.stdout is not None
            taken = json.loads(process.stdout.readline())
            child = taken["child"]
            assert taken["payload"] == "refund 42"
            assert len(held_files(tmp_path)) == (1 if delivered_again else 0)
            queue = c.SimpleQueue("tasks")
            with pytest.raises(queue.Empty):
                queue.get(timeout=0.2)  # its taker runs: it is not anyone else's
            process.send_signal(signal.SIGKILL)
            wait_for(lambda: psutil.Process(process.pid).status() == psutil.STATUS_ZOMBIE)

            if delivered_again:
                message = queue.get(timeout=5)
                assert message.payload == "refund 42"
                message.ack()
            with pytest.raises(queue.Empty):
                queue.get(timeout=0.2)
            assert held_files(tmp_path) == []
            assert child is None or psutil.Process(child).is_running()
        finally:
            process.kill()
            process.wait()
            if child:
                os.kill(child, signal.SIGKILL)


def test_messages_are_taken_in_the_order_they_were_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All within one millisecond of the clock, as a sweep puts its probe jobs on a fast
    machine (Kombu's names took them in any order then), and more put while a worker
    still has the earlier ones listed."""
    monkeypatch.setattr(broker, "monotonic", lambda: 1000.0)
    with Connection(transport=broker.Transport, transport_options=folders(tmp_path)) as c:
        queue = c.SimpleQueue("tasks")
        for n in range(300):
            queue.put(n)
        taken = []
        for _ in range(150):
            message = queue.get(timeout=1)
            taken.append(message.payload)
            message.ack()
        for n in range(300, 400):
            queue.put(n)
        while len(taken) < 400:
            message = queue.get(timeout=1)
            taken.append(message.payload)
            message.ack()

    assert taken == list(range(400))


def test_a_worker_whose_held_folder_was_removed_takes_messages_still(
    channel: broker.Channel, tmp_path: Path
) -> None:
    channel._put("tasks", {"body": "first"})
    assert channel._get("tasks") == {"body": "first"}
    shutil.rmtree(tmp_path / "held")

    channel._put("tasks", {"body": "second"})
    assert channel._get("tasks") == {"body": "second"}


def test_a_message_put_back_from_a_killed_taker_comes_before_newer_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even when the worker had the newer ones listed already."""
    monkeypatch.setattr(broker, "PUT_BACK_EVERY_SECONDS", 0)
    with Connection(transport=broker.Transport, transport_options=folders(tmp_path)) as c:
        queue = c.SimpleQueue("tasks")
        queue.put("refund 1")
        process = subprocess.Popen(
            [sys.executable, "-c", TAKE, json.dumps(folders(tmp_path)), "holds"],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert process.stdout is not None
            assert json.loads(process.stdout.readline())["payload"] == "refund 1"
            for n in (2, 3, 4):
                queue.put(f"refund {n}")
            taken = [queue.get(timeout=1)]  # 3 and 4 stay listed
            process.send_signal(signal.SIGKILL)
            process.wait()
            taken += [queue.get(timeout=1) for _ in range(3)]
        finally:
            process.kill()
            process.wait()
        for message in taken:
            message.ack()

    assert [m.payload for m in taken] == ["refund 2", "refund 1", "refund 3", "refund 4"]


def test_a_message_requeued_or_left_unacknowledged_at_close_goes_back_once(
    tmp_path: Path,
) -> None:
    options = folders(tmp_path)
    with Connection(transport=broker.Transport, transport_options=options) as c:
        queue = c.SimpleQueue("tasks")
        queue.put("refund 42")
        queue.get(timeout=1).requeue()
        assert held_files(tmp_path) == []
        assert queue.get(timeout=1).payload == "refund 42"
        assert len(held_files(tmp_path)) == 1
    # Closed with the message unacknowledged: back on the queue, and held no more.
    assert held_files(tmp_path) == []
    with Connection(transport=broker.Transport, transport_options=options) as c:
        queue = c.SimpleQueue("tasks")
        assert queue.get(timeout=1).payload == "refund 42"
        with pytest.raises(queue.Empty):
            queue.get(timeout=0.2)


CELERY_APP = """
import json, os
from pathlib import Path
from celery import Celery

folder = Path(os.environ["JOBS_FOLDER"])
app = Celery("jobs", broker="filesystem://localhost//")
app.conf.update(
    broker_transport="ledger.broker:Transport",
    broker_transport_options=json.loads(os.environ["BROKER_FOLDERS"]),
    task_acks_late=True,
    worker_prefetch_multiplier=1,
)


@app.task(name="refund")
def refund() -> None:
    (folder / f"started by {os.getpid()}").touch()
    with open(folder / "go"):  # a FIFO: waits until the test opens it to write
        pass
    (folder / f"done by {os.getpid()}").touch()
"""


def test_a_celery_worker_killed_in_a_job_leaves_it_to_the_next_worker(tmp_path: Path) -> None:
    """The ledger's own settings (late acknowledgement), a real Celery worker killed
    with SIGKILL halfway through a job: the worker started after it does the job. With
    Kombu's own transport the job was gone with the first worker."""
    (tmp_path / "jobs.py").write_text(CELERY_APP)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    os.mkfifo(jobs / "go")
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "JOBS_FOLDER": str(jobs),
        "BROKER_FOLDERS": json.dumps(folders(tmp_path)),
    }

    def worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "jobs", "worker", "--pool", "solo",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING"],
            cwd=tmp_path, env=env, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    first = worker()
    second = None
    try:
        subprocess.run(
            [sys.executable, "-c", "import jobs; jobs.refund.delay()"],
            cwd=tmp_path, env=env, check=True,
        )  # fmt: skip
        wait_for(lambda: (jobs / f"started by {first.pid}").exists())
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)

        second = worker()
        wait_for(lambda: (jobs / f"started by {second.pid}").exists())
        with open(jobs / "go", "w"):  # lets the job go on
            pass
        wait_for(lambda: (jobs / f"done by {second.pid}").exists())
        assert sorted(file.name for file in jobs.iterdir()) == sorted(
            ["go", f"started by {first.pid}", f"started by {second.pid}", f"done by {second.pid}"]
        )
        wait_for(lambda: held_files(tmp_path) == [])  # acknowledged after the job
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()
                process.wait()
