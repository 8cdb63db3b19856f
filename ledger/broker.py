"""The embedded broker: Kombu's filesystem transport, with no file read half-written
and no job lost with a killed worker.

Kombu's own transport writes a message by creating its file and then writing to it. A
worker that lists the folder between the two takes the empty file, cannot decode it
and stops, and the message is lost with it (celery/kombu#1551); `make run` then had
to start the worker again. Here a message is written under a name that no worker reads
(Kombu reads only names ending in `.<queue>.msg`) and renamed into place, which POSIX
makes atomic: a worker sees a message whole or not at all.

An exchange's table of bindings has the same gap: the process that creates it writes
it only after it has locked it, and a process that declares the same queue meanwhile
(web, worker and beat at the first start, or two producers) read it empty and stopped.
Here the table is created and changed under the lock alone, and an empty one, just
created, is read as what it is: no bindings yet.

And Kombu's transport deletes a message as a worker takes it, keeping it only in the
worker's memory until the job is acknowledged, so a worker killed (SIGKILL, the kernel)
lost every job it held. Here a worker takes a message by renaming it into a folder of
its own, and deletes it there only once acknowledged; a message held by a process that
is gone (the folder's lock, which the process holds while it runs, is free) is put back
on its queue by the next process that looks (`put_back_what_the_dead_held`), as Redis
and RabbitMQ deliver again what a lost connection held.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Callable
from queue import Empty
from time import monotonic, monotonic_ns
from typing import IO, Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem, virtual
from kombu.transport.filesystem import exchange_queue_t
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads
from kombu.utils.objects import cached_property

PARTIAL = ".partial"
LOCK = "lock"  # in a process's folder of held messages, locked while it runs
# How often a consuming process looks for messages held by processes that are gone,
# besides when it starts: a worker killed beside others gets its jobs back this soon.
PUT_BACK_EVERY_SECONDS = 10.0

type Bindings = list[exchange_queue_t]


class QoS(virtual.QoS):
    """Kombu's bookkeeping of unacknowledged messages, which also lets go of a
    message's held file once the message is acknowledged or rejected."""

    channel: Channel

    def ack(self, delivery_tag: str) -> None:
        super().ack(delivery_tag)
        self.channel.let_go(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        super().reject(delivery_tag, requeue=requeue)  # requeued through _restore
        self.channel.let_go(delivery_tag)


class Channel(filesystem.Channel):
    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for folder in (self.data_folder_in, self.data_folder_out, self.control_folder):
            os.makedirs(folder, exist_ok=True)
        self._held: dict[str, str] = {}  # delivery tag: the file held for it
        self._listed: dict[str, list[str]] = {}  # queue: names not tried yet, last first
        self._last_put_back = float("-inf")

    @cached_property
    def held_folder(self) -> str:
        """Where each consuming process keeps, in a folder of its own, the messages it
        has taken and not yet acknowledged."""
        return str(self.transport_options.get("held_folder", "held"))

    def _get(self, queue: str, timeout: Any = None) -> Any:
        """Take the next message of `queue` by moving it into this process's held
        folder; the rename is atomic, so of two workers one takes it.

        Listing and sorting the folder for each message, as Kombu does, cost 10 ms a
        message with 10,000 waiting: a worker lists it again only once it has tried
        every name of its last listing (taken by others meanwhile, or by itself)."""
        if monotonic() - self._last_put_back >= PUT_BACK_EVERY_SECONDS:
            if put_back_what_the_dead_held(self.held_folder, self.data_folder_in):
                self._listed.clear()  # older than what is listed: their turn first
            self._last_put_back = monotonic()
        mine = _own_folder(self.held_folder)
        listed, listed_now = self._listed.get(queue, []), False
        while True:
            if not listed:
                if listed_now:
                    raise Empty()
                listed, listed_now = self._waiting(queue), True
                self._listed[queue] = listed
                continue
            name = listed.pop()
            held = os.path.join(mine, name)
            try:
                os.rename(os.path.join(self.data_folder_in, name), held)
            except FileNotFoundError:
                continue  # another worker took it
            try:
                with open(held, "rb") as file:
                    payload = loads(bytes_to_str(file.read()))
            except OSError as exc:
                raise ChannelError(f"Cannot read file {held!r} from queue.") from exc
            tag = payload.get("properties", {}).get("delivery_tag")
            if tag is None:  # not a Kombu message: nothing will acknowledge it
                os.unlink(held)
            else:
                self._held[tag] = held
            return payload

    def _waiting(self, queue: str) -> list[str]:
        """The names of the messages waiting on `queue`, the oldest last."""
        suffix = f"{queue}.msg"
        names = (n for n in os.listdir(self.data_folder_in) if n.partition(".")[2] == suffix)
        return sorted(names, reverse=True)

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack, **kwargs)
        if message is not None and no_ack:
            self.let_go(message.delivery_tag)
        return message

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Callable[[Any], Any], consumer_tag: str,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        if no_ack:
            taken = callback

            def callback(message: Any) -> Any:
                self.let_go(message.delivery_tag)
                return taken(message)

        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)

    def _restore(self, message: Any) -> None:
        """Put an unacknowledged message back (a rejection that requeues, a closing
        channel), then let go of the file held for it."""
        super()._restore(message)
        self.let_go(message.delivery_tag)

    def let_go(self, delivery_tag: str) -> None:
        """Done with the message `delivery_tag`: delete its held file (or keep it in the
        processed folder, when the transport is told to)."""
        held = self._held.pop(delivery_tag, None)
        if held is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if self.store_processed:
                os.replace(held, os.path.join(self.processed_folder, os.path.basename(held)))
            else:
                os.unlink(held)

    # Named as Kombu's filesystem Channel names them, which its base class does not.
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Put the message on `queue` under a name that sorts in the order messages
        are put. Kombu's names start with the milliseconds of the machine's monotonic
        clock, so that messages put within one millisecond were taken in any order
        (and, when the count gained a digit, later ones first); here the nanoseconds
        are written with every digit."""
        name = f"{monotonic_ns():020d}_{uuid.uuid4()}.{queue}.msg"
        path = os.path.join(self.data_folder_out, name)
        body = str_to_bytes(dumps(payload))
        try:
            with open(path + PARTIAL, "wb") as partial:
                partial.write(body)
            os.replace(path + PARTIAL, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path + PARTIAL)
            raise ChannelError(f"Cannot add file {path!r} to directory") from exc

    def get_table(self, exchange: str) -> Bindings:
        file = self._exchange_file(exchange)
        try:
            with file.open("rb") as table:
                fcntl.flock(table.fileno(), fcntl.LOCK_SH)
                return _bindings(table)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        binding = exchange_queue_t(routing_key or "", pattern or "", queue or "")
        self.control_folder.mkdir(exist_ok=True)
        self._change_table(
            exchange,
            lambda bindings: bindings if binding in bindings else [binding, *bindings],
            create=True,
        )

    def _delete(  # type: ignore[override]
        self, queue: str, exchange: str, routing_key: str, pattern: str, *args: Any, **kwargs: Any
    ) -> None:
        # The virtual channel's own bookkeeping, which Kombu's filesystem Channel calls
        # before it changes the table.
        super(filesystem.Channel, self)._delete(
            queue, exchange, routing_key, pattern, *args, **kwargs
        )
        binding = exchange_queue_t(routing_key or "", pattern or "", queue or "")
        self._change_table(
            exchange, lambda bindings: [b for b in bindings if b != binding], create=False
        )

    def _change_table(
        self, exchange: str, change: Callable[[Bindings], Bindings], *, create: bool
    ) -> None:
        """Read, change and write an exchange's table under its exclusive lock,
        creating it (without emptying one that exists) when `create`."""
        file = self._exchange_file(exchange)
        try:
            descriptor = os.open(file, os.O_RDWR | (os.O_CREAT if create else 0), 0o666)
        except FileNotFoundError:
            return  # removed meanwhile: nothing to change
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc
        with open(descriptor, "rb+", buffering=0) as table:
            fcntl.flock(table.fileno(), fcntl.LOCK_EX)
            bindings = _bindings(table)
            changed = change(bindings)
            if changed != bindings:
                table.seek(0)
                table.write(str_to_bytes(dumps(changed)))
                table.truncate()


def _bindings(table: IO[bytes]) -> Bindings:
    """The bindings a table holds; none in one created and not written yet."""
    written = table.read()
    if not written:
        return []
    return [exchange_queue_t(*binding) for binding in loads(bytes_to_str(written))]


def put_back_what_the_dead_held(held_folder: str, queue_folder: str) -> int:
    """Put back on their queues the messages held by processes that are gone, under
    the names they had, so that they are taken again in their turn; how many.

    A process holds the lock of its folder from the moment the folder has its name until
    it ends, however it ends (the kernel lets go of a killed process's locks), so a
    folder whose lock can be taken is a dead process's. The folder is emptied and
    removed under that lock, so two processes looking at once do not both empty it."""
    put_back = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(held_folder):
            if name.startswith("."):
                continue  # a folder being made
            folder = os.path.join(held_folder, name)
            try:
                lock = os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # being removed by another process
            try:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its process runs (or another is emptying it)
                for message in os.listdir(folder):
                    if message != LOCK:
                        os.rename(
                            os.path.join(folder, message), os.path.join(queue_folder, message)
                        )
                        put_back += 1
                os.unlink(os.path.join(folder, LOCK))
                os.rmdir(folder)
            finally:
                os.close(lock)
    return put_back


# This process's folder in each held folder, with the descriptor that locks it.
_own: dict[str, tuple[str, int]] = {}


def _own_folder(held_folder: str) -> str:
    """This process's folder in `held_folder`: made under a name no one looks at, with
    its lock taken, then named for good; made again if it is gone."""
    if held_folder in _own and not os.path.isdir(_own[held_folder][0]):
        # Removed by hand: every take would fail as if another worker had taken it.
        os.close(_own.pop(held_folder)[1])
    if held_folder not in _own:
        os.makedirs(held_folder, exist_ok=True)
        making = os.path.join(held_folder, f".{uuid.uuid4()}")
        os.mkdir(making)
        lock = os.open(os.path.join(making, LOCK), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        folder = os.path.join(held_folder, f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
        os.rename(making, folder)
        _own[held_folder] = (folder, lock)
    return _own[held_folder][0]


def _forget_own_folders() -> None:
    """In a forked child: its parent's folders are not its own, and the child's copy of
    a lock would keep the folder of a parent killed before it from being put back."""
    for _, lock in _own.values():
        os.close(lock)
    _own.clear()


os.register_at_fork(after_in_child=_forget_own_folders)


class Transport(filesystem.Transport):
    Channel = Channel
