"""The cheapest possible OpenAI-shaped backend, for measuring the router and not the backend: a
raw asyncio HTTP/1.1 server (keep-alive, Content-Length bodies) that answers every POST with one
small completion and GET /metrics with an idle exposition. Run: python _stub_backend.py PORT."""

from __future__ import annotations

import asyncio
import sys

_COMPLETION = (
    b'{"id":"c","object":"text_completion","created":0,"model":"m","choices":[{"index":0,"text":"ok",'
    b'"finish_reason":"stop","logprobs":null}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)
_METRICS = b'kvasir_requests_waiting{model_name="m"} 0\nkvasir_requests_running{model_name="m"} 0\nkvasir_kv_cache_usage_ratio{model_name="m"} 0\n'


def _response(body: bytes, content_type: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (content_type, len(body))
    return head + body


COMPLETION = _response(_COMPLETION, b"application/json")
METRICS = _response(_METRICS, b"text/plain")


class _Stub(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            self.transport.write(METRICS if head.startswith(b"get /metrics") else COMPLETION)


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_Stub, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
