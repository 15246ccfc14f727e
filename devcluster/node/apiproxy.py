"""The API server as a real node's pods reach it: a TCP relay from the node's address
to the API server's loopback address.

The API server listens on loopback only, which a pod's network namespace cannot reach.
Each node's namespace rewrites the ``kubernetes`` Service's address to
``<node address>:<port>`` (what kube-proxy would program, :func:`.host.expose_api`), and
this relay, in the host's namespace, carries those connections on to the API server.
TLS passes through untouched: the pod checks the API server's own certificate.

Run as a script (no imports from the project, so any Python runs it)::

    python apiproxy.py LISTEN_HOST:PORT TARGET_HOST:PORT
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

CHUNK = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until end of stream, then pass the end on."""
    with contextlib.suppress(OSError):
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


async def _relay(target: tuple[str, int], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
    try:
        up_reader, up_writer = await asyncio.open_connection(*target)
    except OSError:
        writer.close()
        return
    try:
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    finally:
        for w in (writer, up_writer):
            w.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def serve(listen: tuple[str, int], target: tuple[str, int]) -> None:
    """Relay every connection to ``listen`` to ``target``, until killed."""
    server = await asyncio.start_server(
        lambda r, w: _relay(target, r, w), *listen, reuse_address=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    """``apiproxy.py LISTEN TARGET``."""
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    asyncio.run(serve(_address(argv[0]), _address(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
