"""The embedded broker: Kombu's filesystem transport, with messages that appear whole.

Kombu's own transport writes a message by creating its file and then writing to it. A
worker that lists the folder between the two takes the empty file, cannot decode it
and stops, and the message is lost with it (celery/kombu#1551); `make run` then stops
the whole ledger with its worker. Here a message is written under a name that no
worker reads (Kombu reads only names ending in `.<queue>.msg`) and renamed into place,
which POSIX makes atomic: a worker sees a message whole or not at all.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

PARTIAL = ".partial"


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


class Transport(filesystem.Transport):
    Channel = Channel
