"""The embedded broker: Kombu's filesystem transport, with files never read half-written.

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
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Callable
from time import monotonic
from typing import IO, Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.transport.filesystem import exchange_queue_t
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

PARTIAL = ".partial"

type Bindings = list[exchange_queue_t]


class Channel(filesystem.Channel):
    # Named as Kombu's filesystem Channel names them, which its base class does not.
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Put the message on `queue`, named as Kombu names it so that workers take
        messages in the order Kombu gives them."""
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
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


class Transport(filesystem.Transport):
    Channel = Channel
