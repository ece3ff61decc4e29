"""What several commands share: the configuration from flags and environment, a request from a file or a case."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def config_from_args(args: argparse.Namespace, **overrides: Any):
    """The config file (`--config`, else TOOLQUAKE_CONFIG, else the packaged profiles) with the flags over it;
    a bad config ends the command with a message naming the key."""
    from toolquake.proxy.server.config import ConfigError, load_config

    path = args.config or os.environ.get("TOOLQUAKE_CONFIG") or None
    try:
        return load_config(path, overrides=overrides)
    except ConfigError as exc:
        sys.exit(f"toolquake: {exc}")


def load_request(args: argparse.Namespace) -> dict[str, Any]:
    """The request of `--request FILE|-`, or the chat-completions request of BFCL case `--case ID`."""
    if args.request:
        try:
            with open(args.request, "rb") if args.request != "-" else sys.stdin.buffer as f:
                body = json.loads(f.read())
        except (OSError, json.JSONDecodeError) as exc:
            sys.exit(f"toolquake: cannot read request {args.request}: {exc}")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            sys.exit("toolquake: the request must be a chat-completions JSON object with a 'messages' list")
        return body
    from toolquake.bfcl.cases import request_for_case

    try:
        return request_for_case(args.case)
    except (LookupError, FileNotFoundError) as exc:
        sys.exit(f"toolquake: {exc}")
