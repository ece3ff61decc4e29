"""Secret-shaped strings out of the recording (proxy/live/recording.py): a `Redactor` walks a whole record and
replaces every secret it finds, in every string, by `[redacted]`.

What counts as a secret, in three layers:

- the regular expressions of `detect-secrets`' plugins (Yelp, Apache-2.0): AWS access key ids, Azure storage
  keys, credentials in URLs, Discord, GitHub, GitLab, Mailchimp, PyPI, SendGrid, Slack (tokens and webhooks),
  Square, Stripe, Telegram and Twilio keys, private-key headers. Only the plugins whose patterns are linear
  in time on hostile text are used (`LIBRARY_DETECTORS`; tests/cases/test_recording_redaction.py times every
  one on 1 MiB adversarial strings). Left out: OpenAI and JWT (their patterns backtrack: seconds on 16 KiB of
  `sk-a` or `eyJ`), npm (`//.+/:_authToken`: quadratic), the keyword-assignment forms of IBM, Cloudant,
  SoftLayer and the AWS secret key (linear but 0.5–4 s per MiB, and covered by `OWN_PATTERNS`' assignment
  form), Artifactory (matches ordinary upper-case words), public IP addresses (not secrets), and the
  high-entropy and keyword plugins (not patterns: they flag ids, hashes and base64 content by the dozen);
- `OWN_PATTERNS`, for what the library misses or finds only in part: every `sk-` key (OpenAI `sk-proj-`,
  Anthropic `sk-ant-api03-`, ...), Stripe keys of every kind and length, Google API keys, GitHub fine-grained
  tokens, npm tokens, JWTs, Hugging Face tokens, `Bearer` tokens, `Authorization:` values, `Cookie:` and
  `Set-Cookie:` values, a password in a URL with no user (`redis://:pw@host`), `password = ...`-style
  assignments (also with the quotes of JSON inside a JSON string, `{\"api_key\": \"...\"}`, and of a list:
  all of it), and `pass`/`pwd` as a quoted key, before `=` or after a separator (never the word in prose);
  each starts only where a token starts or at a fixed word, and uses possessive repeats, so it never
  backtracks; `Basic <base64>` anywhere, when the base64 decodes to readable `user:password` text;
- the operator's `[record] redact` patterns.

Beyond patterns: PEM private-key blocks are cut whole (from `-----BEGIN ... PRIVATE KEY-----` to its
`-----END`, or to the end of the text); under a key named like a secret (`password`, `api_key`,
`client_secret`, `token`, `pwd`, `pass`, `db_pass`, ...) a string or a number is replaced whole, and so is
every one in a list there (an object there, such as a tool's parameter schema, is walked as usual); a string
that is JSON (call arguments, a tool result) is redacted as what it decodes to and written back as JSON, so
escapes hide nothing, keys count, and JSON inside a JSON string is decoded in turn. A match is widened to the
end of its token, so a key longer than the shape a pattern knows is not left half there.

All matching uses the `regex` module, which releases the GIL while it matches (the writer thread never
holds up the event loop) and takes a timeout: a text whose scan takes more than `[record] redact_timeout`
seconds of CPU (a slow operator pattern on a large text) is replaced whole, never written unscanned.
"""

from __future__ import annotations

import base64
import importlib
import json
import re
import time
from typing import Any

import regex
import structlog

log = structlog.get_logger("toolquake.record")

REDACTED = "[redacted]"
#: CPU seconds one text may take to scan (all patterns together); past it the whole text is replaced
SCAN_TIMEOUT_S = 5.0
#: detect-secrets plugins used: module -> (class, indices of its `denylist` patterns used; None = all)
LIBRARY_DETECTORS: dict[str, tuple[str, tuple[int, ...] | None]] = {
    "aws": ("AWSKeyDetector", (0,)),  # the access key id; the secret key's context pattern: OWN_PATTERNS
    "azure_storage_key": ("AzureStorageKeyDetector", None),
    "basic_auth": ("BasicAuthDetector", None),
    "cloudant": ("CloudantDetector", (2, 3)),  # the URL forms
    "discord": ("DiscordBotTokenDetector", None),
    "github_token": ("GitHubTokenDetector", None),
    "gitlab_token": ("GitLabTokenDetector", None),
    "mailchimp": ("MailchimpDetector", None),
    "private_key": ("PrivateKeyDetector", None),
    "pypi_token": ("PypiTokenDetector", None),
    "sendgrid": ("SendGridDetector", None),
    "slack": ("SlackDetector", None),
    "softlayer": ("SoftlayerDetector", (1,)),  # the URL form
    "square_oauth": ("SquareOAuthDetector", None),
    "stripe": ("StripeDetector", None),
    "telegram_token": ("TelegramBotTokenDetector", None),
    "twilio": ("TwilioKeyDetector", None),
}
_T = r"A-Za-z0-9_\-"  # the characters of a token
_START = rf"(?<![{_T}])"  # a match starts only where a token starts: no quadratic restarts inside a run
#: an optional quote around a key or value, possibly backslash-escaped (JSON inside a JSON string: {\"k\": \"v\"})
_Q = r"(?:\\{0,3}+[\"'])?"
#: a value's characters: up to a quote, space or separator; a backslash only when it escapes no quote
_VALUE = r"(?:[^\s\"'`,;<>\\]|\\(?![\"']))"
#: a value that is already `[redacted]` is left as it is: redacting a redacted text changes nothing
_NOT_REDACTED = r"(?!\[++redacted\])"
_KEYWORD = (r"(?i:(?:api|access|secret|private|client|auth|session|refresh|master|signing)[_\-]?(?:access[_\-]?)?"
            r"(?:key|token|secret)|password|passwd|passphrase|secret|credentials?)")
#: our own secret shapes (a capture group, where there is one, is the part replaced)
OWN_PATTERNS: tuple[str, ...] = (
    rf"{_START}sk-[{_T}]{{16,}}+",  # OpenAI (sk-, sk-proj-, sk-svcacct-), Anthropic (sk-ant-api03-...), DeepSeek
    rf"{_START}(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{{10,}}+",  # Stripe secret, restricted, publishable keys
    rf"{_START}whsec_[A-Za-z0-9]{{16,}}+",  # Stripe webhook secrets
    rf"{_START}AIza[{_T}]{{30,}}+",  # Google API keys
    rf"{_START}gh[pousr]_[A-Za-z0-9_]{{20,}}+",  # GitHub tokens of any length
    rf"{_START}github_pat_[A-Za-z0-9_]{{20,}}+",  # GitHub fine-grained tokens
    rf"{_START}npm_[A-Za-z0-9]{{30,}}+",  # npm tokens
    rf"{_START}xox[abeoprs]-[A-Za-z0-9\-]{{10,}}+",  # Slack tokens in any form
    rf"{_START}eyJ[{_T}]{{8,}}+\.[{_T}]{{4,}}+(?:\.[{_T}=+/]*+)?",  # JWT
    rf"{_START}hf_[A-Za-z0-9]{{30,}}+",  # Hugging Face tokens
    r"(?<![A-Za-z0-9])(?i:bearer)\s{1,8}+([A-Za-z0-9._~+/\-]{8,}+=*+)",  # Bearer <token>
    rf"(?i:authorization){_Q}\s{{0,8}}+[:=]\s{{0,8}}+{_Q}(?:(?i:basic|bearer|token|digest)\s{{1,8}}+)?"
    r"((?:[^\s\"',;\\]|\\(?![\"'])){6,}+)",  # Authorization: <value>
    rf"(?<![A-Za-z0-9]){_KEYWORD}{_Q}\s{{0,8}}+(?::=|=>|[:=])\s{{0,8}}+{_Q}{_NOT_REDACTED}({_VALUE}{{6,}}+)",  # x = v
    rf"(?<![A-Za-z0-9]){_KEYWORD}{_Q}\s{{0,8}}+[:=]\s{{0,8}}+\[(?!redacted\])([^\[\]\r\n]++)\]",  # x = [list]
    # `pass` and `pwd` are ordinary words: only as a quoted key ("pass": ...), right before `=` (pass=...), or
    # after a separator (db_pass: ...)
    rf"(?:(?<![A-Za-z0-9_\-.])(?i:pass|pwd)(?:\\{{0,3}}+[\"']\s{{0,8}}+[:=]|=)|(?<=[A-Za-z0-9][_\-.])(?i:pass|pwd)"
    rf"{_Q}\s{{0,8}}+[:=])\s{{0,8}}+{_Q}(?![/~]){_NOT_REDACTED}({_VALUE}{{4,}}+)",  # not PWD=/home
    # cookie headers, when a `name=value` follows: the whole value, to the end of the line or the quote
    rf"(?<![A-Za-z0-9_\-])(?i:(?:set-)?cookie){_Q}\s{{0,8}}+:\s{{0,8}}+{_Q}"
    r"(?=[A-Za-z0-9!#$%&'*+\-.^_`|~]{1,256}+=)((?:[^\r\n\"\\]|\\(?![\"']))++)",
    r"://[^\s:@/{}]{0,256}+:([^\s@/{}]++)@",  # a password in a URL, with or without a user (redis://:pw@host)
)
#: `Basic <base64>` anywhere (not only after `Authorization:`): a secret when the base64 decodes to readable
#: `user:password` text (`basic_credentials`), so "a basic understanding" stays
BASIC_PATTERN = r"(?<![A-Za-z0-9])(?i:basic)\s{1,8}+([A-Za-z0-9+/]{8,}+={0,2}+)"
_PEM_BEGIN = r"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----"
_PEM_END = "-----END "
#: widening a match: the characters a key or token continues with
_WIDEN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-+/=")
#: dict keys whose string values are replaced whole (compared lower-case, without `_`, `-`, `.`)
_SECRET_KEY_ENDINGS = ("password", "passwd", "passphrase", "secret", "apikey", "token", "authorization",
                       "privatekey", "accesskey", "secretkey", "credential", "credentials", "cookie", "pwd")
#: secret keys only as the key's last word (`pass`, `db_pass`, `dbPass`, but not `bypass` or `compass`)
_SECRET_LAST_WORDS = ("pass",)
_SEPARATORS = "_-. "
#: the flags a `re` pattern of the library keeps when compiled with `regex` (the values are the same)
_FLAGS = re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE | re.ASCII


def library_patterns() -> list[regex.Pattern[str]]:
    """The used detect-secrets plugins' patterns, compiled with `regex`."""
    out = []
    for module, (name, indices) in LIBRARY_DETECTORS.items():
        cls = getattr(importlib.import_module(f"detect_secrets.plugins.{module}"), name)
        denylist = list(cls.denylist)
        for i in indices if indices is not None else range(len(denylist)):
            p = denylist[i]
            out.append(regex.compile(p.pattern, p.flags & _FLAGS))
    return out


def last_word(key: str) -> str:
    """A key's last word, lower-case: after its last separator, or from its last capital in a camelCase word."""
    word = key[max(key.rfind(c) for c in _SEPARATORS) + 1:]
    if not (word.isupper() or word.islower()):
        caps = [i for i, c in enumerate(word) if c.isupper()]
        if caps:
            word = word[caps[-1]:]
    return word.lower()


def secret_key(key: str) -> bool:
    k = key.lower().replace("_", "").replace("-", "").replace(".", "")
    return (k.endswith(_SECRET_KEY_ENDINGS) and k not in ("maxtoken", "tokens")) \
        or last_word(key) in _SECRET_LAST_WORDS


def basic_credentials(b64: str) -> bool:
    """Whether base64 text decodes to `user:password`: readable text with a colon (no control characters)."""
    try:
        text = base64.b64decode(b64 + "=" * (-len(b64) % 4), validate=True).decode("utf-8")
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
        return False
    return ":" in text and text.isprintable()


class ScanTimeout(Exception):
    pass


class Redactor:
    """Replaces every secret-shaped part of every string of a record (dict keys included) by `[redacted]`."""

    def __init__(self, patterns: list[str] | tuple[str, ...] = (), timeout: float = SCAN_TIMEOUT_S) -> None:
        self.patterns = [*library_patterns(), *(regex.compile(p) for p in OWN_PATTERNS),
                         *(regex.compile(p) for p in patterns)]
        self.basic = regex.compile(BASIC_PATTERN)
        self.pem = regex.compile(_PEM_BEGIN)
        self.timeout = timeout
        self.timeouts = 0  # texts replaced whole because their scan took too long

    # -- one text
    def spans(self, text: str, deadline: float) -> list[tuple[int, int]]:
        """Where the secrets of `text` are: sorted, possibly overlapping (start, end) spans."""
        found: list[tuple[int, int]] = []
        try:
            for pattern in self.patterns:
                for m in pattern.finditer(text, timeout=self._left(deadline)):
                    if m.re.groups:  # the secret is the captured part (a password in a URL, a value)
                        found += [m.span(g) for g in range(1, m.re.groups + 1) if m.start(g) < m.end(g)]
                    elif m.start() < m.end():
                        found.append(m.span())
            for m in self.basic.finditer(text, timeout=self._left(deadline)):
                if basic_credentials(m.group(1)):
                    found.append(m.span(1))
            if "-----BEGIN " in text:  # PEM private-key blocks: to their END line, or to the end of the text
                pos = 0
                for m in self.pem.finditer(text, timeout=self._left(deadline)):
                    if m.start() < pos:
                        continue
                    end = text.find(_PEM_END, m.end())
                    if end < 0:
                        found.append((m.start(), len(text)))
                        break
                    close = text.find("-----", end + len(_PEM_END))
                    pos = len(text) if close < 0 else close + 5
                    found.append((m.start(), pos))
        except TimeoutError:
            raise ScanTimeout from None
        found.sort()
        return found

    @staticmethod
    def _left(deadline: float) -> float:
        left = deadline - time.thread_time()
        if left <= 0:
            raise ScanTimeout
        return left

    def text(self, value: str) -> str:
        if not value:
            return value
        try:
            spans = self.spans(value, time.thread_time() + self.timeout)
        except ScanTimeout:
            self.timeouts += 1
            log.warning("record_redaction_timeout", chars=len(value), timeout_s=self.timeout)
            return REDACTED
        if not spans:
            return value
        parts, pos = [], 0
        n = len(value)
        for start, end in spans:
            if end <= pos:
                continue
            start = max(start, pos)
            while end < n and value[end] in _WIDEN:  # the rest of the key (each character looked at once)
                end += 1
            parts += [value[pos:start], REDACTED]
            pos = end
        parts.append(value[pos:])
        return "".join(parts)

    # -- a whole structure
    def __call__(self, value: Any, key: str | None = None) -> Any:
        """`value` redacted; `key` is the dict key it is under: under a secret-named key, a string or a number is
        replaced whole, and so is every one in a list there (objects under it are walked as usual)."""
        secret = key is not None and secret_key(key)
        if isinstance(value, str):
            if secret and value:
                return REDACTED
            return self.string(value, key == "arguments")
        if secret and isinstance(value, (int, float)) and not isinstance(value, bool):
            return REDACTED
        if isinstance(value, list):
            return [self(v, key if secret else None) for v in value]
        if isinstance(value, dict):
            return {(self.text(k) if isinstance(k, str) else k): self(v, k if isinstance(k, str) else None)
                    for k, v in value.items()}
        return value

    def string(self, value: str, is_json: bool = False) -> str:
        """A string; one that is JSON (call arguments, `is_json`; a tool result or any text that is a JSON object,
        array or string) is redacted as what it decodes to (escapes hide nothing, secret-named keys count, JSON
        inside a JSON string is decoded again) and stays JSON. Too deeply nested to walk: replaced whole."""
        if is_json or value.lstrip()[:1] in ('{', '[', '"'):
            try:
                decoded = json.loads(value)
                if is_json or isinstance(decoded, (dict, list, str)):
                    redacted = self(decoded)
                    return value if redacted == decoded else json.dumps(redacted, ensure_ascii=False)
            except ValueError:
                pass
            except RecursionError:
                return REDACTED
        return self.text(value)
