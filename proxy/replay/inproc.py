"""The proxy served in this process, for replays that bring no proxy of their own."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import msgspec

from toolquake.proxy.replay.errors import ReplayError


class InProcessProxy:
    """`create_app` served by uvicorn on a free loopback port, in a thread of this process.

    Replay runs each profile strictly (a perturber that fails fails the pair, which is recorded as
    an error and retried) unless `fail_open`, and passes calls to tools the proxy added through to be
    graded (`injected_calls = "pass"`: a call to an added tool is BFCL's `wrong_function`); live scoring
    is off (replay grades the answers itself), and each finished exchange is kept by request id so
    that grading sees what the perturbers did.
    """

    def __init__(self, config: Any, *, fail_open: bool = False, admin_token: str | None = None) -> None:
        from toolquake.proxy.server.config import ScoringConfig

        profiles = {name: msgspec.structs.replace(spec, strict=not fail_open, injected_calls="pass")
                    for name, spec in config.profiles.items()}
        scoring = msgspec.structs.replace(config.scoring if isinstance(config.scoring, ScoringConfig)
                                          else ScoringConfig(), enabled=False, match_content=False)
        self.config = msgspec.structs.replace(config, profiles=profiles, scoring=scoring)
        #: the admin API's token (`toolquake sweep` puts its profiles in through it); None: the admin API is off
        self.admin_token = admin_token
        self.exchanges: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def _observe(self, asked: Any, served: Any) -> None:
        with self._lock:
            self.exchanges[asked.request_id] = served

    def take(self, request_id: str | None) -> Any:
        if not request_id:
            return None
        with self._lock:
            return self.exchanges.pop(request_id, None)

    def start(self, timeout: float = 30.0) -> str:
        import uvicorn

        from toolquake.proxy import live
        from toolquake.proxy.server.app import create_app

        def keep_requests(_app: Any, st: Any) -> None:
            st.observers.append(self._observe)

        # live.attach with scoring off: the case resolver only (perturbers such as tool_removal need the case); the
        # tracing wing first when `[tracing] enabled` (the proxy's spans join the replay's: proxy/replay/tracing.py)
        extensions: list[Any] = [live.attach, keep_requests]
        if self.config.tracing.enabled:
            from toolquake.proxy import tracing

            extensions.insert(0, tracing.attach)
        app = create_app(self.config, admin_token=self.admin_token, extensions=extensions)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                                     timeout_graceful_shutdown=5, server_header=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="toolquake-replay-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ReplayError("the in-process proxy did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(15)
