"""Makes the chat-completions conformance checker raise, loaded as a plugin (`[server] plugins`), to prove that a
checker that fails never breaks a request (it is counted instead)."""

from toolquake.proxy.server.conformance import chat


def _raise(*args, **kwargs):
    raise RuntimeError("this checker always fails")


chat.check_stream = _raise
chat.check_answer = _raise
